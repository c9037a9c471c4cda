"""Train a tiny HF transformers causal LM with linear-attention layers, unchanged, with backend="hc".

Qwen3-Next alternates Gated DeltaNet layers with attention. Without flash-linear-attention installed,
HF runs the delta rule as a plain-PyTorch chunk loop; under hc that loop is traced as hccompile's
delta-rule op (forward and backward) and the layer's short convolution as shifted sums, so one graph
serves every sequence length. The report says what was lowered; the loss is checked against the same
steps run eagerly.

On a CPU the example stops short of Inductor's code generation (compiler="aot_eager") to run in
seconds; on a GPU it compiles with Inductor and runs our Triton kernels."""
import copy

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

import hccompile

device = "cuda" if torch.cuda.is_available() else "cpu"
options = {} if device == "cuda" else {"compiler": "aot_eager"}
torch.manual_seed(0)
config = Qwen3NextConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"], num_experts=0,
    mlp_only_layers=[0, 1], pad_token_id=0, bos_token_id=1, eos_token_id=2)
model = Qwen3NextForCausalLM(config).to(device)
eager = copy.deepcopy(model)


def train(net, steps, lengths):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(3, 128, (2, lengths[step % len(lengths)]), generator=gen).to(device)
        loss = net(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


lengths = [96, 160, 130]  # one, two and three chunks of HF's 64
compiled = torch.compile(model, backend="hc", dynamic=True, options=options)
ours = train(compiled, 3, lengths)
theirs = train(eager, 3, lengths)
print("losses, hc:   ", [f"{x:.5f}" for x in ours])
print("losses, eager:", [f"{x:.5f}" for x in theirs])
assert all(abs(a - b) < 1e-3 * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)

report = hccompile.explain(model, torch.randint(3, 128, (1, 130), device=device), options=options)
print(report)
lowered = [m["client"] for m in report.matches if m["pattern"] == "substitute"]
assert lowered == ["transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule"], \
    report.matches
