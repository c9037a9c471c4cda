import struct
import subprocess
import sys
import zlib

import torch

from hccompile.debug.plot import Panel, bar_chart_png


def demo(*args, timeout=900):
    r = subprocess.run([sys.executable, "-m", "hccompile", "demo", "--dim", "32", "--heads", "2", "--layers", "1",
                        "--iters", "1", "--batch", "2", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def read_png(path):
    """Width, height and RGB rows of the plot writer's PNG form (one IDAT, 8-bit RGB, filter 0)."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = body
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    assert len(raw) == stride * height
    return width, height, [raw[y * stride + 1:(y + 1) * stride] for y in range(height)]


def test_plot_bars_are_proportional_and_missing_values_say_so(tmp_path):
    path = tmp_path / "p.png"
    bar_chart_png(str(path), "t", [Panel("step", [("a", {"x": 4.0, "y": 1.0}), ("b", {"x": None, "y": 2.0})], "ms")],
                  ["x", "y"])
    width, height, rows = read_png(path)
    lengths = {}
    for color in ((120, 120, 120), (66, 133, 244)):  # the palette's first two series
        runs = [sum(1 for i in range(0, len(r), 3) if tuple(r[i:i + 3]) == color) for r in rows]
        lengths[color] = sorted({n for n in runs if n > 20})
    x_bars, y_bars = lengths[(120, 120, 120)], lengths[(66, 133, 244)]
    assert len(x_bars) == 1 and len(y_bars) == 2  # b's x bar is missing ("n/a"), y's two differ
    assert abs(y_bars[1] / y_bars[0] - 2.0) < 0.05 and abs(x_bars[0] / y_bars[1] - 2.0) < 0.05


def test_demo_linear_attention_and_mhc_against_eager():
    out = demo("--seq", "40", "--sections", "linear,mhc")
    assert "correctness vs eager" in out and "-> OK" in out and "MISMATCH" not in out
    assert "causal_linear_attn" in out
    assert "| hc |" in out and "| inductor |" in out
    assert "gradients against no recompute (dropout on): identical -> OK" in out  # bit-identical at this size


def test_demo_delta_rule_and_htree_lowered_with_a_plot(tmp_path):
    plot = tmp_path / "dumps" / "demo.png"
    out = demo("--seq", "40", "--delta-seq", "128", "--sections", "gdn,kda,htree", "--inductor", "htree",
               "--plot", str(plot))
    # the layers' chunk functions, traced as the op (hccompile.substitutes): one per section
    assert out.count("substitute×1; refused 0") == 2, out[-3000:]
    assert "hccompile.htree_attention.default" in out and "hccompile.chunk_delta_rule_backward.default" in out
    assert out.count("-> OK") == 3 and "MISMATCH" not in out
    assert "inductor left out of this section" in out
    assert "| GDN | OK |" in out and "| htree | OK |" in out
    width, height, _ = read_png(plot)
    assert width > 200 and height > 200


def test_demo_rejects_unknown_sections():
    r = subprocess.run([sys.executable, "-m", "hccompile", "demo", "--sections", "gdn,flash"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown section 'flash'" in r.stderr and "Traceback" not in r.stderr


def test_half_precision_check_asks_float32_only_past_the_tolerance():
    import torch

    from hccompile.demo import _check

    exact = torch.ones(100, dtype=torch.float64)
    eager = exact + 0.03 * torch.randn(100, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    close_hc = exact + 0.03 * torch.randn(100, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    calls = []

    def float32_run():
        calls.append(1)
        return exact, [exact]

    # hc and eager round differently (each ~3% off float32, 4% apart): passes as close to float32 as eager
    assert _check((close_hc, [exact]), (eager, [exact]), float32_run, 0.02)[0] and calls == [1]
    # far from float32 (a wrong answer): fails
    assert not _check((exact * 1.5, [exact]), (eager, [exact]), float32_run, 0.02)[0]
    # within the tolerance: float32 never runs; without an arbiter, past the tolerance fails
    calls.clear()
    assert _check((exact, [exact]), (exact, [exact]), float32_run, 0.02)[0] and not calls
    assert not _check((close_hc, [exact]), (eager, [exact]), None, 0.02)[0]


def test_saved_bytes_frees_what_it_measured():
    """The saved-bytes run keeps nothing alive: on the H100 the demo's eager graphs outlived their
    section (an identity pack hook makes a saved output and its grad_fn a cycle gc cannot free when
    no backward runs) and the htree section ran out of memory."""
    import gc
    import weakref

    from hccompile.demo import saved_bytes

    seen = []

    def fn(x):
        y = (x * 2).exp()  # exp saves its output
        seen.append(weakref.ref(y))
        return y.sum()

    x = torch.randn(1000, requires_grad=True)
    assert saved_bytes(fn, x) == 4000  # exp keeps its output; x * 2 and sum keep nothing
    gc.collect()
    assert seen[0]() is None, "the saved-bytes run leaked its graph"
