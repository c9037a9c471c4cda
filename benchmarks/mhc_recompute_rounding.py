"""How far the bf16 gradients of the mHC recompute plans differ from no recompute on CUDA, in units
that survive parameters whose true gradient is ~0 (their bf16 gradient is rounding noise), beside a
dropout mask replayed wrong (another seed), and beside the same plan run again ("off-again": what
the kernels' and Inductor's reductions give twice). The bounds of tests/test_hc_passes.py::
test_gpu_bf16_recompute_with_dropout_is_exact come from this. Run from the repository root;
--dim/--heads/--batch/--seq/--layers/--layouts change the model (defaults: the test's).

    python benchmarks/mhc_recompute_rounding.py --dim 1024 --heads 16 --batch 4 --seq 4096 --layouts bsnc"""
import argparse, sys, time
sys.path.insert(0, "tests")
import torch
from helpers import Collect
from hccompile.nn.mhc import MHCGPT

def step(m, x, opts, seed):
    torch._dynamo.reset()
    cm = torch.compile(m, backend=Collect(**opts))
    torch.manual_seed(seed); cm(x)
    torch.manual_seed(seed); m.zero_grad(set_to_none=True)
    out = cm(x)
    w = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    (out.float() * w).sum().backward()
    return out.detach(), [p.grad.clone().float() for p in m.parameters()]

p = argparse.ArgumentParser()
p.add_argument("--dim", type=int, default=64)
p.add_argument("--heads", type=int, default=2)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--seq", type=int, default=128)
p.add_argument("--layouts", default="bsnc,sbnc,folded")
a = p.parse_args()
for layout in a.layouts.split(","):
    t = time.time()
    torch.manual_seed(0)
    m = MHCGPT(a.dim, a.heads, a.layers, n=4, layout=layout, sinkhorn_iters=8, dropout=0.1,
               contract="sum" if layout == "folded" else "mean").cuda().bfloat16()
    names = [n for n, _ in m.named_parameters()]
    x = torch.randn(a.batch, a.seq, a.dim, device="cuda", dtype=torch.bfloat16)
    off = step(m, x, {"hc_recompute": "off"}, 1)
    G = torch.cat([g.flatten() for g in off[1]]); gmax = max(g.norm().item() for g in off[1])
    for name, (out, g) in {"off-again": step(m, x, {"hc_recompute": "off"}, 1), "block": step(m, x, {}, 1),
                           "seed2": step(m, x, {"hc_recompute": "off"}, 2)}.items():
        D = torch.cat([a.flatten() - b.flatten() for a, b in zip(g, off[1])])
        per = [((a - b).norm().item(), b.norm().item(), n) for n, a, b in zip(names, g, off[1])]
        big = [(n, f"d/|g|={d / max(gn, 1e-30):.2g}", f"|g|/max={gn / gmax:.2g}", f"d/max={d / gmax:.2g}")
               for d, gn, n in per if d > 0.02 * gn]
        print(f"{layout} {name}: global rel {(D.norm() / G.norm()).item():.3e}; max d/max {max(d for d, _, _ in per) / gmax:.3e}; "
              f"min over params d/max {min(d for d, _, _ in per) / gmax:.3e}", flush=True)
        if name != "seed2":
            for b in big: print("   ", *b)
    print(layout, f"{time.time()-t:.0f}s", flush=True)
