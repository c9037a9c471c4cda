"""mHC detection (every layout, and refusal of look-alikes) and the block recompute plan (with the
hyper-connections fused by hc_fuse, the default; tests/test_hc_fuse.py compares with it off)."""
import pytest
import torch
from torch import nn

import hccompile.passes.hc_fuse  # noqa: F401  (registers the pass now)

from hccompile import compat
from hccompile.nn import TinyLinearTransformer
from hccompile.nn.mhc import MHCGPT
from hccompile.passes.recompute import default_block_length
from helpers import Collect, train_step


def _detect(model, x):
    be = Collect(compiler="aot_eager")
    torch.compile(model, backend=be)(x)
    return be


@pytest.mark.parametrize("layout", ["bsnc", "sbnc", "folded"])
@pytest.mark.parametrize("init,eps", [("exp", 0.0), ("softmax", 1e-3)])
def test_every_layout_detected(layout, init, eps):
    m = MHCGPT(32, 2, 2, n=4, layout=layout, sinkhorn_iters=4, sinkhorn_init=init, eps=eps,
               contract="sum" if layout == "folded" else "mean")
    be = _detect(m, torch.randn(2, 8, 32))
    layers = [x for x in be.matches if x["pattern"] == "mhc_layer"]
    assert [x["layer"] for x in layers] == [0, 1, 2, 3]
    assert all(x["sinkhorn_rounds"] == 4 for x in layers)
    # consecutive: each layer's input stream is the previous layer's output
    assert all(layers[i + 1]["x"] == layers[i]["x_out"] for i in range(3))
    assert not [r for r in be.refusals if r["pattern"] == "mhc_layer"]


def test_models_without_hyper_connections_yield_nothing():
    for m, x in ((MHCGPT(32, 2, 2, n=1), torch.randn(2, 8, 32)),
                 (TinyLinearTransformer(32, 2, 1), torch.randn(2, 8, 32))):
        be = _detect(m, x)
        assert not [x for x in be.matches if x["pattern"] in ("mhc_layer", "hc_block_recompute")]


class LookAlike(nn.Module):
    """Hyper-connection-like code that is not mHC: one-sided normalisation, or tanh mappings."""

    def __init__(self, kind, n=4, C=16):
        super().__init__()
        self.kind, self.n = kind, n
        self.phi = nn.Linear(n * C, n * n + 2 * n, bias=False)
        self.f = nn.Linear(C, C)

    def forward(self, x):  # [B, S, n, C]
        n = self.n
        proj = self.phi(x.flatten(-2))
        pre, post, res = proj[..., :n], proj[..., n:2 * n], proj[..., 2 * n:].unflatten(-1, (n, n))
        if self.kind == "row_softmax":  # one-sided: rows only, repeated
            m = res.exp()
            for _ in range(4):
                m = m / m.sum(-1, keepdim=True)
        elif self.kind == "one_round":
            m = res.exp()
            m = m / m.sum(-1, keepdim=True)
            m = m / m.sum(-2, keepdim=True)
        else:  # original hyper-connections: tanh, no Sinkhorn
            m = torch.tanh(res)
        y = torch.einsum("bsn,bsnc->bsc", torch.sigmoid(pre), x)
        return torch.einsum("bsmn,bsmc->bsnc", m, x) + 2 * torch.sigmoid(post).unsqueeze(-1) * self.f(y).unsqueeze(-2)


@pytest.mark.parametrize("kind", ["row_softmax", "one_round", "tanh"])
def test_look_alikes_not_detected(kind):
    be = _detect(LookAlike(kind), torch.randn(2, 8, 4, 16))
    assert not [x for x in be.matches if x["pattern"] == "mhc_layer"]


def test_default_block_length_is_papers():
    assert default_block_length(4, 60) == 6
    assert default_block_length(4, 8) == 2
    assert default_block_length(1, 1) == 1


@pytest.fixture(scope="module")
def mhc_runs():
    torch.manual_seed(0)
    m = MHCGPT(32, 2, 2, n=4, layout="bsnc", sinkhorn_iters=4, dropout=0.1)
    x = torch.randn(2, 16, 32, requires_grad=True)
    runs = {}
    for name, opts in {"off": {"hc_recompute": "off"}, "block": {}, "layer": {"hc_recompute": "layer"},
                       "block3": {"hc_recompute_block": 3},
                       "no_norm": {"hc_recompute_include_norm": False},
                       "no_bda": {"hc_recompute_include_bda": False},
                       "no_activation": {"hc_recompute_include_activation": False}}.items():
        saved, be, out, grads = train_step(m, x, **opts)
        runs[name] = (saved, be.reports[0], out, grads)
    return runs


def test_saved_bytes_equal_plan_and_drop(mhc_runs):
    for name, (measured, report, _, _) in mhc_runs.items():
        assert measured == report.saved_bytes["bytes"], name
    assert mhc_runs["block"][0] < mhc_runs["layer"][0] < mhc_runs["off"][0]


def test_gradients_with_dropout_equal_exactly(mhc_runs):
    _, _, out_off, g_off = mhc_runs["off"]
    for name in ("block", "layer", "block3", "no_norm", "no_bda", "no_activation"):
        _, _, out, grads = mhc_runs[name]
        assert torch.equal(out, out_off), name
        assert all(torch.equal(a, b) for a, b in zip(grads, g_off)), name


def test_options_change_plan_as_documented(mhc_runs):
    plan = {k: v[1].recompute_plan for k, v in mhc_runs.items()}
    assert plan["off"] == []
    # 4 sublayers, n=4: default L_r = round(sqrt(4*4/6)) = 2
    assert [b["layers"] for b in plan["block"]] == [[0, 1], [2, 3]]
    assert [b["layers"] for b in plan["layer"]] == [[0], [1], [2], [3]]
    assert [b["layers"] for b in plan["block3"]] == [[0, 1, 2], [3]]
    for b in plan["block"]:
        assert len(b["saved"]) == 1 + len(b["layers"])  # block input + each sublayer output
    assert mhc_runs["no_norm"][0] > mhc_runs["block"][0]   # norm outputs saved instead
    assert mhc_runs["no_bda"][0] > mhc_runs["block"][0]    # streams inside a block saved
    # the MLP's GELU output saved beside its input: one [tokens, 4C] float32 tensor per MLP
    assert mhc_runs["no_activation"][0] - mhc_runs["block"][0] == 2 * (2 * 16 * 4 * 32 * 4)
    hidden = [e for e in mhc_runs["block"][1].saved_bytes["names"] if e.split(":")[1] == "(32, 128)"]
    assert len(hidden) == 2, mhc_runs["block"][1].saved_bytes["names"]   # the pre-activations only
    md = mhc_runs["block"][1].to_markdown()
    assert "## Recompute plan" in md and "Saved for backward" in md


def _gpu_bf16_plans(layout):
    """Output, gradients and report of one bf16 training step on CUDA with dropout 0.1, under
    hc_recompute off, block and layer, the same dropout seed in each."""
    torch.manual_seed(0)
    m = MHCGPT(64, 2, 2, n=4, layout=layout, sinkhorn_iters=8, dropout=0.1,
               contract="sum" if layout == "folded" else "mean").cuda().bfloat16()
    x = torch.randn(2, 128, 64, device="cuda", dtype=torch.bfloat16)
    runs = {}
    for name, opts in {"off": {"hc_recompute": "off"}, "block": {}, "layer": {"hc_recompute": "layer"}}.items():
        torch._dynamo.reset()
        be = Collect(**opts)
        cm = torch.compile(m, backend=be)
        torch.manual_seed(1)
        cm(x)
        torch.manual_seed(1)
        m.zero_grad(set_to_none=True)
        out = cm(x)
        w = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
        (out.float() * w).sum().backward()
        runs[name] = (out.detach(), [p.grad.clone() for p in m.parameters()], be.reports[0])
    assert runs["block"][2].recompute_plan and "emulate_precision_casts" in runs["block"][2].inductor_settings
    if compat.has_inductor_option("static_launch_user_defined_triton_kernels"):
        # the steps compared bit for bit below ran our kernels through Inductor's static launcher
        for _, _, report in runs.values():
            assert report.inductor_settings["static_launch_user_defined_triton_kernels"][0] is True
    return runs


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bsnc", "sbnc", "folded"])
def test_gpu_bf16_recompute_with_dropout_is_exact(layout):
    """On CUDA in bfloat16 dropout is never replayed: the recompute plans' outputs are the same bits
    as without recompute. Their backward graphs differ, so Inductor fuses and rounds the gradients
    differently: each gradient is within 2% of its norm plus 1e-4 of the largest gradient's norm.
    Measured on the H100 (2026-11-25, 42 parameters): bsnc bit-identical; in sbnc and folded every
    gradient above 3e-4 of the largest norm is within 2% of its own norm (all within 0.4% of the
    largest), and the mapping parameters whose true gradient is ~0 (the bf16 gradient is rounding
    noise, up to 48x its own tiny norm) differ by at most 4.1e-5 of the largest norm. A dropout
    mask replayed wrong (another seed) puts the gradients 53% off overall."""
    runs = _gpu_bf16_plans(layout)
    out_off, g_off, _ = runs["off"]
    largest = max(g.float().norm().item() for g in g_off)
    for name in ("block", "layer"):
        out, grads, _ = runs[name]
        assert torch.equal(out, out_off), name
        off_by = [(i, (a.float() - b.float()).norm().item(), b.float().norm().item())
                  for i, (a, b) in enumerate(zip(grads, g_off))]
        bad = [(i, d, n) for i, d, n in off_by if not d <= 2e-2 * n + 1e-4 * largest]
        assert not bad, f"{name}: (parameter, |difference|, |gradient|) {bad}, largest {largest:.3g}"
