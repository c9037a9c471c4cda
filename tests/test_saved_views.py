"""passes/saved_views.py: views feeding our ops are rebuilt in backward, so a rewritten graph
compiles under Inductor with a symbolic length (it fell back to plain Inductor with
"cannot determine truth value of Relational: 1 < s27" when a saved [1, s, H, D] view was a forward
output)."""
import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from helpers import Collect, fwd_bwd, rel_err
from hccompile.nn.delta_net import GatedDeltaNet, KimiDeltaAttention


@pytest.fixture
def reference_op(monkeypatch):
    """The op's plain-PyTorch fallback instead of interpreted kernels (CPU only: KDA's kernels
    take minutes in the interpreter); the pass and Inductor's handling are what is tested."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("route", ["substitute", "delta_rule pass"])
@pytest.mark.parametrize("layer", [GatedDeltaNet, KimiDeltaAttention])
def test_delta_layers_compile_with_a_symbolic_length_batch_one(layer, route, reference_op):
    """Both routes to the op: the chunk function traced as the op (hccompile.substitutes, the
    default) and, with substitutes disabled, the delta_rule pass rewriting the unrolled loop."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = layer(32, num_heads=2, head_dim=16).to(device)
    disabled = ("substitutes",) if route == "delta_rule pass" else ()
    be = Collect(strict=True, disable_passes=disabled)  # strict: a failed compile raises instead of falling back
    cm = torch.compile(m, backend=be, dynamic=True, fullgraph=True)
    x = torch.randn(1, 70, 32, device=device)
    out, grads = fwd_bwd(cm, x)
    ref, ref_grads = fwd_bwd(m, x)
    report = be.reports[0]
    assert report.fallback is None
    assert [m["pattern"] for m in report.matches if m["pattern"] in ("substitute", "delta_rule")] == \
        [route.split()[0]]
    notes = [note for p in report.passes if p.name == "saved_views" for note in p.notes]
    assert len(notes) == 1 and "replayed in backward" in notes[0], notes
    assert rel_err(out, ref) < 1e-4 and rel_err(grads[0], ref_grads[0]) < 1e-4


def test_only_views_of_op_inputs_are_tagged_and_earlier_tags_stay():
    import torch.fx as fx

    from hccompile.config import resolve
    from hccompile.debug.report import PassRecord
    from hccompile.passes.base import PassContext
    from hccompile.passes.saved_views import SavedViewsPass

    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.sin, (x,))            # computed: the base, saved
    v1 = g.call_method("view", (y, 1, 4, 2, 2))     # views of it feed the op
    v2 = g.call_method("permute", (v1, 0, 1, 2, 3))
    tagged = g.call_method("unsqueeze", (y, 0))     # a view already in a recompute block
    tagged.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    other = g.call_method("view", (y, 16))          # a view no op reads
    op = g.call_function(torch.ops.hccompile.mhc_aggregate.default, (v2, tagged))
    g.output((op, other))
    gm = fx.GraphModule(torch.nn.Module(), g)
    record = PassRecord("saved_views", "dynamo")
    assert SavedViewsPass().run(gm, PassContext(config=resolve({}), example_inputs=[]), record)
    assert {n.name for n in gm.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE} == \
        {v1.name, v2.name}
    assert tagged.meta["recompute"] == CheckpointPolicy.MUST_SAVE and "recompute" not in y.meta
    assert "recompute" not in other.meta
