"""Float32 stream-sized buffers in the compiled mHC step's code (issue 18): the benchmark's model
(MHCGPT, layout [B, S, n, C], bf16, dropout 0.1) at a small size under hc, one forward+backward, and
every buffer Inductor allocates with the stream's trailing dims (n, C), by dtype and graph. The
stream's gradient should stay in bfloat16 between the ops; session 40's dump of the C1024 step had a
float32 copy beside it in every sublayer's backward (buf84, from the post's dx as an n-long sum).

    python benchmarks/analysis/mhc_stream_grad_buffers.py [--dim 256 --layers 2 --batch 2 --seq 256]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--n", type=int, default=4)
    a = p.parse_args()
    from torch._inductor.utils import run_and_get_code

    import hccompile  # noqa: F401  (registers backend="hc")
    from hccompile.nn.mhc import MHCGPT

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = MHCGPT(a.dim, a.heads, a.layers, n=a.n, dropout=0.1, layout="bsnc", sinkhorn_iters=20).to(
        device, torch.bfloat16)
    x = torch.randn(a.batch, a.seq, a.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    fn = torch.compile(model, backend="hc")
    _, codes = run_and_get_code(lambda: fn(x).float().square().sum().backward())
    pattern = re.compile(r"(buf\d+) = empty_strided_\w+\(\(([^)]*)\), \([^)]*\), (torch\.\w+)\)")
    for index, code in enumerate(codes):
        counts = collections.Counter()
        for name, sizes, dtype in pattern.findall(code):
            if sizes.replace(" ", "").endswith(f"{a.n},{a.dim}"):
                counts[dtype] += 1
        print(f"graph {index}: stream-sized buffers by dtype {dict(counts)}")


if __name__ == "__main__":
    main()
