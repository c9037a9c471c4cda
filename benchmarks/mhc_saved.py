"""Saved-for-backward bytes of one training step with hc's block recompute against Inductor's own plan,
for every form of hyper-connections hc detects (issue 18's target: <= 0.6x for each): hccompile.nn's
MHCGPT in its three layouts ([B, S, n, C], [S, B, n*C], and the folded [B, S, n*C] with a sum
contraction), the `hyper-connections` package's layers (tests/test_hc_clients.py's model) and the
DeepSeek-V4 style einsum form. Activations only (parameters and the input are not counted), dropout
0.1, the bytes autograd keeps as saved_tensors_hooks see them (tests/helpers.train_step).

    python benchmarks/mhc_saved.py --out benchmarks/results/mhc_saved_<date>_<device>.jsonl
    python benchmarks/mhc_saved.py --device cuda --dtype bfloat16 --out ...

Rows: {"bench": "mhc_saved", "form", "shape", "device", "dtype", "hc_block_bytes", "inductor_bytes",
"ratio"}. --dim/--heads/--batch/--seq size every form (default: the tests' C32, 2 heads, B2 S16).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from targets import run_stamp  # noqa: E402


def forms(device: str, dtype: torch.dtype, dim: int, heads: int, batch: int, seq: int):
    """(form name, model, input): two layers of attention + MLP, n = 4 streams, each form."""
    from hccompile.nn.mhc import MHCGPT

    def gpt(layout: str):
        torch.manual_seed(0)
        model = MHCGPT(dim, heads, 2, n=4, layout=layout, sinkhorn_iters=8, dropout=0.1,
                       contract="sum" if layout == "folded" else "mean")
        return model

    built = {f"MHCGPT {layout}": gpt(layout) for layout in ("bsnc", "sbnc", "folded")}
    import test_hc_clients as clients

    built["V4 einsum [B, S, n, C]"] = clients._v4_model(dim=dim, heads=heads, dropout=0.1)
    if clients.hyper_connections is not None:
        built["hyper-connections package"] = clients._package_model(dim=dim, heads=heads, dropout=0.1)
    else:
        print("hyper-connections package not installed: its form is left out", flush=True)
    for name, model in built.items():
        model = model.to(device, dtype)
        x = torch.randn(batch, seq, dim, device=device, dtype=dtype, requires_grad=True)
        yield name, model, x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--out", default=None, help="append JSON lines here")
    a = p.parse_args()
    from helpers import train_step

    dtype = getattr(torch, a.dtype)
    stamp = run_stamp()
    device_name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    for name, model, x in forms(a.device, dtype, a.dim, a.heads, a.batch, a.seq):
        inductor = train_step(model, x, backend="inductor")[0]
        block = train_step(model, x)[0]
        row = {"bench": "mhc_saved", "form": name, "device": device_name, "dtype": a.dtype,
               "shape": f"C{a.dim} H{a.heads} B{a.batch} S{a.seq} L2 n4",
               "torch": torch.__version__, "hc_block_bytes": block, "inductor_bytes": inductor,
               "ratio": round(block / inductor, 4), **stamp}
        print(f"{name:28s} hc block {block:9d} B, inductor {inductor:9d} B, ratio {block / inductor:.3f}",
              flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
