"""The pipeline itself: entry point, plain models, fallback, strict mode, mode/options."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import hccompile
import hccompile.backend as hc
from hccompile.passes import all_pass_names, passes_for_stage
from hccompile.passes.base import GraphPass
from helpers import Collect, fwd_bwd, rel_err


def test_backend_by_name_without_import(tmp_path):
    """A fresh process that never imports hccompile resolves backend="hc" via the entry point."""
    code = textwrap.dedent("""
        import sys, torch
        assert "hc" in torch._dynamo.list_backends(exclude_tags=()), torch._dynamo.list_backends()
        def f(q, k, v):
            return torch.tril(q @ k.transpose(-2, -1)) @ v
        q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
        out = torch.compile(f, backend="hc", fullgraph=True)(q, k, v)
        torch.testing.assert_close(out, f(q, k, v), rtol=1e-5, atol=1e-5)
        assert "hccompile" in sys.modules  # loaded by torch through the entry point
        print("OK")
    """)
    env = dict(os.environ, HCCOMPILE_DUMP=str(tmp_path), HCCOMPILE_COMPILER="aot_eager")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK" in r.stdout
    (graph_dir,) = tmp_path.glob("graph_*")
    report = (graph_dir / "report.md").read_text()
    assert "causal_linear_attn" in report


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))

    def forward(self, x):
        return torch.softmax(self.net(x), -1) * x[..., :8].sigmoid()


def test_plain_model_same_as_inductor():
    torch.manual_seed(0)
    m = Plain()
    x = torch.randn(4, 16)
    be = Collect()
    out_hc, g_hc = fwd_bwd(torch.compile(m, backend=be), x)
    out_ind, g_ind = fwd_bwd(torch.compile(m, backend="inductor"), x)
    out_eager, g_eager = fwd_bwd(m, x)
    assert be.matches == [] and be.refusals == []
    assert rel_err(out_hc, out_ind) < 1e-6 and rel_err(g_hc[0], g_ind[0]) < 1e-6
    assert rel_err(out_hc, out_eager) < 1e-5 and rel_err(g_hc[0], g_eager[0]) < 1e-5
    # parameters' gradients too
    for be_fn in (lambda: torch.compile(m, backend="hc"), lambda: torch.compile(m, backend="inductor")):
        m.zero_grad()
        be_fn()(x).pow(2).sum().backward()
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        m(x).pow(2).sum().backward()
        assert all(rel_err(a, p.grad) < 1e-5 for a, p in zip(grads, m.parameters()))


class _Exploding(GraphPass):
    name = "exploding_test_pass"
    stage = "dynamo"
    order = 1

    def run(self, gm, ctx, record):
        for n in list(gm.graph.nodes):
            if n.op == "call_function":
                n.target = torch.sin  # break the graph first, then fail: the pass must be undone
        raise RuntimeError("boom")


@pytest.fixture
def exploding_pass(monkeypatch):
    from hccompile.passes import base

    monkeypatch.setitem(base._REGISTRY, _Exploding.name, _Exploding)
    yield
    assert _Exploding.name not in all_pass_names() or True


def test_failing_pass_is_undone_and_warns(exploding_pass):
    def f(q, k, v):
        return torch.tril(q @ k.transpose(-2, -1)) @ v

    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    be = Collect()
    with pytest.warns(UserWarning, match="exploding_test_pass.*boom"):
        out = torch.compile(f, backend=be)(q, k, v)
    torch.testing.assert_close(out, f(q, k, v), rtol=1e-5, atol=1e-5)
    rec = [p for p in be.reports[0].passes if p.name == _Exploding.name][0]
    assert "boom" in rec.error
    assert be.matches, "later passes still run on the restored graph"


def test_strict_reraises(exploding_pass):
    with pytest.raises(Exception, match="boom"):
        torch.compile(lambda x: x * 2, backend="hc", options={"strict": True})(torch.ones(3))


def test_mode_and_inductor_options_accepted():
    x = torch.randn(8)
    # torch.compile takes mode= or options=, not both; each reaches the backend
    for kw in ({"mode": "max-autotune-no-cudagraphs"}, {"options": {"epilogue_fusion": False}}):
        torch._dynamo.reset()
        f = torch.compile(lambda x: x.cos() + 1, backend="hc", **kw)
        torch.testing.assert_close(f(x), x.cos() + 1)


def test_registry_has_stages():
    assert {"hc_detect", "recompute", "linear_attn", "op_inventory"} <= set(all_pass_names())
    # substitutes reports what Dynamo traced as our ops; normalize gives every op one spelling before
    # any matcher reads the graph; detection annotates next; depthwise_conv rewrites after the
    # attention passes looked; recompute tags blocks on the final graph; saved_views tags what is left
    assert [p.name for p in passes_for_stage("dynamo")] == ["substitutes", "normalize", "hc_detect", "hc_fuse",
                                                               "hc_project", "delta_rule", "htree", "linear_attn", "depthwise_conv",
                                                               "recompute", "saved_views"]
    assert [p.name for p in passes_for_stage("post_grad")] == ["op_inventory"]


def test_pipeline_lists_every_pass_once_under_its_stage():
    """The run order is written in passes.PIPELINE (with its reasons), not derived from numbers:
    every registered pass appears there once, under its own stage; an unlisted pass registered by
    a user runs after the listed ones of its stage; a pass listed under the wrong stage is an error."""
    from hccompile.passes import PIPELINE
    from hccompile.passes import base

    listed = [name for names in PIPELINE.values() for name in names]
    assert sorted(listed) == all_pass_names() and len(set(listed)) == len(listed)
    registry = base.registered_passes()
    assert all(registry[name].stage == stage for stage, names in PIPELINE.items() for name in names)

    class Extra(GraphPass):
        name, stage = "test_extra_post_grad", "post_grad"

        def run(self, graph, ctx, record):
            return False

    try:
        base.register_pass(Extra)
        assert [p.name for p in passes_for_stage("post_grad")] == ["op_inventory", "test_extra_post_grad"]
        PIPELINE["joint"] = ("op_inventory",)
        with pytest.raises(ValueError, match="PIPELINE lists pass 'op_inventory' under 'joint'"):
            passes_for_stage("joint")
    finally:
        PIPELINE["joint"] = ()
        base._REGISTRY.pop("test_extra_post_grad", None)


def test_custom_pass_uuid_is_stable_and_tracks_config():
    from hccompile.config import resolve
    from hccompile.debug.report import GraphReport

    def uuid(**opts):
        state = hc._CompileState(resolve(opts, environ={}), GraphReport(0), None, [], None)
        return hc.HCGraphPass("post_grad", state).uuid()

    assert uuid() == uuid()
    assert uuid() != uuid(disable_passes=["linear_attn"])
    # recompute tags live in node meta, invisible to the graph-code cache key: options must count
    assert uuid() != uuid(hc_recompute="off") != uuid(hc_recompute="layer")
    assert uuid() != uuid(hc_recompute_block=3)
    assert uuid() == uuid(dump_dir="/tmp/somewhere")


def test_pass_source_files_include_pass_packages():
    """A pass split into a package (passes/delta_rule/) keys the Inductor cache on each of its modules."""
    from pathlib import Path

    from hccompile.passes import pass_source_files

    package = Path(hccompile.__file__).parent / "passes" / "delta_rule"
    files = {Path(f) for f in pass_source_files()}
    assert set(package.glob("*.py")) <= files
    assert package / "loops.py" in files


def test_einops_calls_are_traced_into_torch_ops():
    """hyper-connections and many attention layers are written in einops. torch 2.11 kept einops'
    functions as opaque graph nodes (no pass could read them); hccompile.compat applies torch 2.13's
    rule there. On every supported torch the Dynamo graph holds the torch ops einops makes, one graph
    over several lengths, equal to eager."""
    einops = pytest.importorskip("einops")

    def f(x, w):
        y = einops.rearrange(x, "b t (h d) -> b h t d", h=2)
        y = einops.einsum(y, w, "b h t d, d e -> b h t e")
        return einops.reduce(einops.repeat(y, "b h t e -> b h t e r", r=2), "b h t e r -> b t (h e)", "sum")

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    fn = torch.compile(f, backend=record, fullgraph=True, dynamic=True)
    w = torch.randn(4, 3)
    for t in (5, 7, 11):
        x = torch.randn(2, t, 8)
        torch.testing.assert_close(fn(x, w), f(x, w))
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if getattr(t, "__module__", "").startswith("einops")], targets
    assert torch.einsum in targets or any("einsum" in str(t) for t in targets), targets


@pytest.mark.parametrize("family", ["linear", "gdn"])
def test_compile_inside_a_users_saved_tensor_hooks(family):
    """A user's pack hook that reads data_ptr() (what offloading and memory-accounting hooks do) is
    active while the model compiles: the passes' own fake propagation must not call it (it undid the
    linear_attn pass on the H100 when the demo compiled inside its memory-counting hook)."""
    from hccompile.nn import TinyDeltaNetModel, TinyLinearTransformer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    if family == "linear":
        model, x = TinyLinearTransformer(32, 2, 1).to(device), torch.randn(2, 40, 32, device=device)
        pattern, options = "causal_linear_attn", {"strict": True}
    else:
        model = TinyDeltaNetModel(vocab=64, hidden_size=32, layers=1, num_heads=2, head_dim=16, chunk_size=8)
        model, x = model.to(device), torch.randint(0, 64, (2, 24), device=device)
        # substitutes off: the delta_rule pass's own fake propagation on the unrolled loop is the point
        pattern, options = "delta_rule", {"strict": True, "disable_passes": ["substitutes"]}
    packed = []

    def pack(t):
        packed.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        report = hccompile.explain(model, x, options=options)
        compiled = torch.compile(model, backend="hc", options=options)
        out = compiled(x)
    assert pattern in [m["pattern"] for m in report.matches], report.refusals
    assert packed  # the hook still saw the real tensors of the runs
    assert rel_err(out.detach(), model(x).detach()) < 1e-4


def test_kernel_inputs_realized_only_inside_the_compile_and_only_when_asked():
    """hc_realize_kernel_inputs: graphs with hyper-connections extend Inductor's needs_realized_inputs with
    our kernel calls (traced launches and hccompile's host ops) for their compile only, and report it; off,
    nothing is added; the registry is as it was afterwards, what it held before included."""
    from torch._inductor.lowering import needs_realized_inputs

    from hccompile import compat
    from hccompile.config import resolve
    from hccompile.debug.report import GraphReport

    targets = compat.kernel_call_targets()
    names = {str(t) for t in targets}
    assert any("hccompile.mhc_post" in n for n in names) and any("triton_kernel_wrapper_mutation" in n
                                                                  for n in names), sorted(names)[:8]
    before = set(needs_realized_inputs)
    with compat.inputs_realized_for(targets + [torch.ops.aten.mm.default]):
        assert set(targets) <= set(needs_realized_inputs)
    assert set(needs_realized_inputs) == before and torch.ops.aten.mm.default in before
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    gm.meta["hc_layers"] = [object()]
    for on in (True, False):
        cfg = resolve(options={"hc_realize_kernel_inputs": on})
        report = GraphReport(graph_id=0)
        hc._choose_inductor_settings(gm, cfg, report, dict(cfg.inductor_patches), False)
        assert (hc.REALIZED_KERNEL_INPUTS in report.inductor_settings) is on


@pytest.mark.parametrize("on_cuda", [False, True])
@pytest.mark.parametrize("user_static", [None, False, True])
def test_inductor_settings_hc_chooses_for_hyper_connections(on_cuda, user_static):
    """Graphs with hyper-connections get emulate_precision_casts everywhere and the static launcher
    for user-defined Triton kernels on CUDA only, each reported with its reason; an option the user
    passed wins and is not reported as hc's; a graph without hyper-connections gets neither."""
    from hccompile.compat import has_inductor_option
    from hccompile.config import resolve
    from hccompile.debug.report import GraphReport

    static = "static_launch_user_defined_triton_kernels"
    options = {} if user_static is None else {static: user_static}
    for layers in ([], [object()]):
        gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        gm.meta["hc_layers"] = layers
        cfg = resolve(options=dict(options))
        report, patches = GraphReport(graph_id=0), dict(cfg.inductor_patches)
        hc._choose_inductor_settings(gm, cfg, report, patches, on_cuda)
        chosen = {name for name in report.inductor_settings}
        if not layers:
            assert chosen == set() and patches == cfg.inductor_patches
            continue
        assert chosen >= {hc.REALIZED_KERNEL_INPUTS}, chosen  # hc_realize_kernel_inputs defaults to on
        if has_inductor_option("emulate_precision_casts"):
            assert patches["emulate_precision_casts"] is True
            assert report.inductor_settings["emulate_precision_casts"] == (True, hc.EXACT_RECOMPUTE_REASON)
        if not has_inductor_option(static):
            assert static not in chosen
        elif user_static is not None:
            assert patches[static] is user_static and static not in chosen
        elif on_cuda:
            assert patches[static] is True and report.inductor_settings[static] == (True, hc.STATIC_LAUNCH_REASON)
        else:
            assert static not in patches and static not in chosen
