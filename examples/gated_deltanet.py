"""Compile a small Gated DeltaNet language model whose recurrence is written in plain PyTorch (the
chunked form, hccompile.nn.delta_net.plain_chunk_gated_delta_rule). The hc backend traces that
function as hccompile's delta-rule op (hccompile.substitutes, once a probe proves them equal: one graph
for every length), forward and backward, and reports it. With the substitutes off, the delta_rule pass
finds the same recurrence in Dynamo's unrolled loop and lowers it (one graph per chunk count).

On a CPU the example stops short of Inductor's code generation (compiler="aot_eager"): the lowering
is the same, and the example runs in seconds instead of minutes."""
import torch

import hccompile
import hccompile.passes.delta_rule  # noqa: F401  (registers the pass; hccompile.passes also does)
from hccompile.nn.delta_net import TinyDeltaNetModel

device = "cuda" if torch.cuda.is_available() else "cpu"
options = {} if device == "cuda" else {"compiler": "aot_eager"}
torch.manual_seed(0)
model = TinyDeltaNetModel(vocab=128, hidden_size=64, layers=2, num_heads=2, head_dim=32, chunk_size=16).to(device)
tokens = torch.randint(0, 128, (2, 40), device=device)

compiled = torch.compile(model, backend="hc", options=options)
torch.testing.assert_close(compiled(tokens), model(tokens), rtol=2e-3, atol=2e-3)

report = hccompile.explain(model, tokens, options=options)
# the chunk function, substituted (one decision per configuration: both layers share it); the layers'
# short convolutions are matches too (depthwise_conv)
assert [m["client"] for m in report.matches if m["pattern"] == "substitute"] == \
    ["hccompile.nn.delta_net.plain_chunk_gated_delta_rule"], report.refusals
print(report)

unrolled = hccompile.explain(model, tokens, options={**options, "disable_passes": ["substitutes"]})
# each layer's unrolled recurrence, lowered by the pass
assert [m["pattern"] for m in unrolled.matches if m["pass"] == "delta_rule"] == ["delta_rule", "delta_rule"], \
    unrolled.refusals
