"""Compile time and graph count of the plain-PyTorch attention layers under hc (issue 21).

For each layer: one torch.compile(backend="hc", dynamic=True) object run at every length of
--lengths (forward and backward); rows
  {"bench": "compile", "model", "backend", "T", "compile_s"}   the first call at that length (Dynamo,
      our passes, Inductor; zero-ish when the graph is reused)
  {"bench": "graphs", "model", "lengths", "graphs", "lowered"}  graphs compiled over all lengths and
      whether an hccompile op reached the forward graph
and the same with backend="inductor" for comparison. Layers: HF transformers' Qwen3-Next GDN,
Qwen3.5 GDN, OLMo-hybrid GDN, Kimi-Linear KDA and MiniMax's lightning attention (tiny configs
through their config classes, as tests/test_hf_clients.py builds them), and hccompile.nn's
plain-PyTorch attention modules.

    python benchmarks/compile_time.py --out benchmarks/results/compile_<date>_<device>.jsonl
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import hccompile  # noqa: E402,F401  (registers backend="hc" and the substitutes)
from helpers import Collect  # noqa: E402
from targets import run_stamp  # noqa: E402

HIDDEN = 64  # the tiny configs' hidden size
# On the CPU, Inductor's C++ reductions guard 16 * B * T <= 4096 (codegen/cpp.py, need_use_acc_helper)
# and recompile past it: there, pass --lengths 96,160,250 to count our graphs, not that guard's.
MODELS = {"qwen3_next": "HF Qwen3-Next GatedDeltaNet", "qwen3_5": "HF Qwen3.5 GatedDeltaNet",
          "olmo_hybrid": "HF OLMo-hybrid GatedDeltaNet", "kimi_linear": "HF Kimi-Linear KDA",
          "minimax": "HF MiniMax lightning",
          "nn_gdn": "hccompile.nn GatedDeltaNet (plain)", "nn_kda": "hccompile.nn KimiDeltaAttention (plain)",
          "nn_lightning": "hccompile.nn LightningAttention (quadratic, decay)",
          "nn_linear": "hccompile.nn PlainCausalLinearAttention"}


def _layer(family: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "nn_gdn":
        from hccompile.nn.delta_net import GatedDeltaNet
        layer = GatedDeltaNet(hidden_size=HIDDEN, num_heads=2, head_dim=16, num_v_heads=4, mode="plain")
    elif family == "nn_kda":
        from hccompile.nn.delta_net import KimiDeltaAttention
        layer = KimiDeltaAttention(hidden_size=HIDDEN, num_heads=2, head_dim=16, mode="plain")
    elif family == "nn_lightning":
        from hccompile.nn.lightning import LightningAttention
        layer = LightningAttention(HIDDEN, 2, form="quadratic")
    elif family == "nn_linear":
        from hccompile.nn.linear_attention import PlainCausalLinearAttention
        layer = PlainCausalLinearAttention(HIDDEN, 2)
    elif family == "minimax":
        from test_hf_clients import _Attention, _minimax
        layer = _Attention(_minimax().layers[0].self_attn)  # called as layer(x): no position embeddings, no mask
    else:
        from test_hf_clients import _tiny
        layer = _tiny(family)
    return layer.to(device=device, dtype=dtype)


def run(family: str, backend: str, lengths: list[int], device: str, dtype: torch.dtype, batch: int) -> list[dict]:
    torch._dynamo.reset()
    layer = _layer(family, device, dtype)
    be = Collect(force_disable_caches=True) if backend == "hc" else "inductor"
    compiled = torch.compile(layer, backend=be, fullgraph=True, dynamic=True)
    rows = []
    for T in lengths:
        x = torch.randn(batch, T, HIDDEN, device=device, dtype=dtype, requires_grad=True)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = compiled(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        rows.append({"bench": "compile", "model": MODELS[family], "backend": backend, "T": T,
                     "compile_s": round(time.perf_counter() - t0, 3)})
    if backend == "hc":
        lowered = any(op.startswith("hccompile.") for r in be.reports for op in r.lowered_ops.get("forward", []))
        rows.append({"bench": "graphs", "model": MODELS[family], "backend": backend, "lengths": lengths,
                     "graphs": len(be.reports), "lowered": lowered})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    ap.add_argument("--backends", default="hc,inductor")
    ap.add_argument("--lengths", default="96,160,288", help="the GPU run's (issue 21); on the CPU see HIDDEN's note")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, help="append the rows (JSON lines) here")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch._inductor.config.force_disable_caches = True  # cold compiles, both backends
    lengths = [int(t) for t in args.lengths.split(",")]
    # run_stamp: the date, a run id and the commit (HCCOMPILE_COMMIT first: the device's .git can be older
    # than the tree it runs)
    meta = {**run_stamp(ROOT), "device": torch.cuda.get_device_name() if device == "cuda"
            else platform.processor() or "cpu", "torch": torch.__version__}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    for family in args.models.split(","):
        for backend in args.backends.split(","):
            for row in run(family, backend, lengths, device, getattr(torch, args.dtype), args.batch):
                row.update(meta)
                print(json.dumps(row), flush=True)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
