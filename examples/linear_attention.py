"""Compile a model whose attention is plain-PyTorch causal linear attention; print the report."""
import torch

import hccompile
from hccompile.nn import TinyLinearTransformer

device = "cuda" if torch.cuda.is_available() else "cpu"
model = TinyLinearTransformer(dim=64, num_heads=4, layers=2).to(device)
x = torch.randn(2, 96, 64, device=device)

compiled = torch.compile(model, backend="hc", fullgraph=True)
out = compiled(x)
torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
print(hccompile.explain(model, x))
