"""Would a one-card sequence split of the state sweeps pay (R5 of benchmarks/analysis/gdn_traffic_2026-11-26.md)?
Measured before building it, from kernels that exist: one sequence's state_forward / state_backward sweep
(chunk.py) against cp.py's summary kernels over the same tokens cut into S segments, which walk the S
pieces side by side with K more columns ([H | M], [dH | M^T]). A split sweep would cost the summary kernel,
plus a merge (one tiny launch) and the chunk-parallel incoming-state pass (about one output kernel's time);
this prints the first beside the sweep it would replace, per kernel, from torch.profiler.

    python benchmarks/sweep_split.py                      # GDN B1 T32768 H16 D128 bf16, S = 2, 4, 8
    python benchmarks/sweep_split.py --pieces 4,16 --out benchmarks/results/sweep_split_$(date +%F).jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _profile import profile_step  # noqa: E402
from delta_rule import make_inputs, parse_shape  # noqa: E402


def kernel_ms(step, names: tuple[str, ...]) -> dict[str, float]:
    """ms per step of each kernel whose name contains one of `names` (torch.profiler)."""
    step()
    _, summary = profile_step(step, steps=5, top=200)
    return {name: sum(r["ms"] for r in summary["top"] if name in r["kernel"]) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="B1T32768H16D128")
    parser.add_argument("--pieces", default="2,4,8", help="segment counts S to cut each sequence into")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_split.py times kernels on a CUDA device")
    from hccompile.kernels.delta_rule import chunk_delta_rule_bwd, chunk_delta_rule_fwd
    from hccompile.kernels.delta_rule.cp import summary_backward, summary_forward

    shape = parse_shape(args.shape)
    x = make_inputs(shape, "scalar", torch.bfloat16)
    batch, time = x["q"].shape[:2]
    common = dict(gate="scalar", use_qk_l2norm_in_kernel=True)
    do = torch.randn_like(x["v"])
    meta = {"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    rows = []

    def forward():
        chunk_delta_rule_fwd(x["q"], x["k"], x["v"], x["beta"], x["g"], **common)

    def backward():
        chunk_delta_rule_bwd(x["q"], x["k"], x["v"], x["beta"], x["g"], **common, do=do)

    rows.append({**meta, "what": "sweeps, one walk per sequence",
                 **kernel_ms(forward, ("_state_forward_kernel",)), **kernel_ms(backward, ("_state_backward_kernel",))})
    flat = {n: t.reshape(1, batch * time, *t.shape[2:]) for n, t in x.items()}
    flat_do = do.reshape(1, batch * time, *do.shape[2:])
    for pieces in [int(p) for p in args.pieces.split(",") if p]:
        cu = [0]
        for b in range(batch):  # every sequence in `pieces` equal segments (chunk-aligned)
            step = -(-time // pieces // 64) * 64
            cu += [b * time + min(time, (i + 1) * step) for i in range(pieces) if i * step < time]
        cu_seqlens = torch.tensor(cu, dtype=torch.int64, device="cuda")

        def summary_fwd():
            summary_forward(flat["q"], flat["k"], flat["v"], flat["beta"], flat["g"], cu_seqlens=cu_seqlens, **common)

        def summary_bwd():
            summary_backward(flat["q"], flat["k"], flat["v"], flat["beta"], flat["g"], cu_seqlens=cu_seqlens,
                             do=flat_do, **common)

        rows.append({**meta, "what": f"summaries over {len(cu) - 1} segments", "segments": len(cu) - 1,
                     **kernel_ms(summary_fwd, ("_summary_forward_kernel",)),
                     **kernel_ms(summary_bwd, ("_summary_backward_kernel",))})
    for row in rows:
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
