"""Compile a tiny model whose attention is lightning attention written in plain PyTorch — the
decay-masked quadratic form and lightning attention 2's block loop — with backend="hc", check it
against eager, and print the report that shows the lowering to hccompile::lightning_attn."""
import torch

import hccompile
from hccompile.nn.lightning import TinyLightningTransformer

device = "cuda" if torch.cuda.is_available() else "cpu"
# On a CPU, Inductor's C++ code generation dominates a tiny model's compile; aot_eager runs the same
# passes and ops without it.
options = {} if device == "cuda" else {"compiler": "aot_eager"}
torch.manual_seed(0)
x = torch.randn(2, 40, 32, device=device)

for form in ("quadratic", "block"):
    model = TinyLightningTransformer(dim=32, num_heads=2, layers=2, form=form, block_size=16).to(device)
    compiled = torch.compile(model, backend="hc", fullgraph=True, options=options)
    out = compiled(x)
    out.sum().backward()  # the backward runs hccompile::lightning_attn_backward
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)

    report = hccompile.explain(model, x, options=options)
    lowered = [(m["pattern"], m["op"]) for m in report.matches]
    print(f"## form={form!r}: lowered {lowered}\n")
    print(report)
    assert [op for _, op in lowered] == ["lightning_attn"] * 2, report.refusals
