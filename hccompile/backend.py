"""The `hc` backend: Dynamo graph -> our Dynamo-stage passes -> compile_fx(config_patches) with our
joint-graph and post-grad passes installed -> Inductor codegen.

Registered under the name "hc" by the `torch_dynamo_backends` entry point (pyproject.toml), so
`torch.compile(m, backend="hc")` works without importing hccompile. Never also decorate this with
`@register_backend("hc")`: the name would be registered twice and the lookup would fail.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import compat
from . import lowering  # noqa: F401  (custom ops must exist before any cached graph runs)
from .config import HCConfig, resolve
from .debug.dump import Dumper, graph_code, install_depyf_hook
from .debug.memory import saved_activation_bytes
from .debug.report import GraphReport, PassRecord
from .passes import pass_source_files, passes_for_stage
from .passes.base import PassContext

log = logging.getLogger("hccompile")

_graph_ids = itertools.count()
_collect = threading.local()  # explain() gathers GraphReports here


def _copy_nodes_into(dst: fx.Graph, src: fx.Graph) -> None:
    val_map: dict[fx.Node, fx.Node] = {}
    out = dst.graph_copy(src, val_map)
    dst.output(out)
    for old, new in val_map.items():
        new.name = old.name if new.name != old.name and old.name not in dst._graph_namespace._used_names \
            else new.name
        # Dynamo keeps facts on placeholder nodes as attributes (e.g. _dynamo_source)
        for attr, value in vars(old).items():
            if attr.startswith("_dynamo"):
                setattr(new, attr, value)


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    _copy_nodes_into(new, graph)
    return new


def _restore_graph(graph: fx.Graph, snapshot: fx.Graph) -> None:
    """Put `snapshot`'s nodes back into `graph` in place (hooks must mutate the graph they get)."""
    for n in reversed(list(graph.nodes)):
        graph.erase_node(n)
    _copy_nodes_into(graph, snapshot)


class _CompileState:
    """Everything one backend call shares with the hooks that Inductor calls later."""

    def __init__(self, cfg: HCConfig, report: GraphReport, dumper: Dumper | None,
                 example_inputs: list[Any], fake_mode: Any):
        self.cfg = cfg
        self.report = report
        self.dumper = dumper
        self.example_inputs = example_inputs
        self.fake_mode = fake_mode
        self.current_graph = "forward"  # set by the inner_compile wrapper before post-grad passes

    def run_passes(self, stage: str, target: Any, graph_name: str) -> None:
        """Run the enabled passes of `stage` on `target` (GraphModule or Graph), recording each."""
        graph = target.graph if isinstance(target, fx.GraphModule) else target
        for pass_cls in passes_for_stage(stage):
            if pass_cls.name in self.cfg.disable_passes:
                continue
            record = PassRecord(pass_cls.name, stage, graph=graph_name, nodes_before=len(graph.nodes))
            self.report.passes.append(record)
            ctx = PassContext(config=self.cfg, example_inputs=self.example_inputs,
                              fake_mode=self.fake_mode, graph_name=graph_name, report=self.report)
            prefix = f"{stage}.{pass_cls.name}.{graph_name}"
            if self.dumper:
                self.dumper.write(f"{prefix}.before.py", graph_code(target))
            snapshot = _copy_graph(graph)
            t0 = time.perf_counter()
            try:
                record.changed = bool(pass_cls().run(target, ctx, record))
            except Exception as e:  # noqa: BLE001 - any pass bug must fall back, not break the model
                record.error = f"{type(e).__name__}: {e}"
                if self.cfg.strict:
                    raise
                _restore_graph(graph, snapshot)
                if isinstance(target, fx.GraphModule):
                    target.recompile()
                warnings.warn(f"hccompile: pass {pass_cls.name!r} failed on the {graph_name} graph "
                              f"({record.error}); its changes were undone. Pass strict=True to "
                              f"raise instead.", stacklevel=2)
                log.debug("pass %s failed", pass_cls.name, exc_info=True)
            record.time_s = time.perf_counter() - t0
            record.nodes_after = len(graph.nodes)
            self.report.add_time(f"hccompile {stage} passes", record.time_s)
            if self.dumper:
                self.dumper.write(f"{prefix}.after.py", graph_code(target))


_NOT_IN_CACHE_KEY = ("dump_dir", "depyf", "strict", "compiler")


class HCGraphPass(CustomGraphPass):
    """One composite pass per Inductor hook; it runs every pass registered for its stage."""

    def __init__(self, stage: str, state: _CompileState, prior: Any = None):
        self.stage = stage
        self.state = state
        self.prior = prior  # a pass the user had installed on the same hook keeps running

    def __call__(self, graph: fx.Graph) -> None:
        name = "joint" if self.stage == "joint" else self.state.current_graph
        self.state.run_passes(self.stage, graph, name)
        if self.prior is not None:
            for p in self.prior if isinstance(self.prior, (list, tuple)) else [self.prior]:
                p(graph)

    def uuid(self) -> Any:
        cfg = self.state.cfg
        # every option a pass reads must be in the key: Dynamo-stage passes also set node tags
        # (recompute policies) that the AOT/FX caches do not see in the graph code
        affecting = {k: v for k, v in sorted(cfg.values.items()) if k not in _NOT_IN_CACHE_KEY}
        extra = repr((self.stage, affecting, [p.name for p in passes_for_stage("dynamo")],
                      [p.name for p in passes_for_stage(self.stage)]))
        prior = self.prior
        if prior is not None:
            extra += repr([getattr(p, "uuid", lambda: None)() for p in
                           (prior if isinstance(prior, (list, tuple)) else [prior])])
        return compat.hash_files(pass_source_files(), extra)


def hc_backend(gm: fx.GraphModule, example_inputs: list[Any], *, mode: str | None = None,
               options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The torch.compile backend. `mode=` and `options=` behave as for backend="inductor"; our own
    options are listed in hccompile.config.OPTIONS (docs/options.md)."""
    cfg = resolve(options, mode)
    return compile_graph(gm, example_inputs, cfg)


hc_backend.__hccompile_backend__ = True  # hccompile.substitutes asks whether hc traces the frame


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any], cfg: HCConfig) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    compat.check_torch_version()
    report = GraphReport(next(_graph_ids), config=cfg.as_dict())
    dumper = Dumper(cfg.dump_dir, report.graph_id) if cfg.dump_dir else None
    if dumper:
        report.dump_dir = dumper.dir
        dumper.write("00_dynamo_graph.py", graph_code(gm))
        if cfg.depyf:
            install_depyf_hook(cfg.dump_dir)
    state = _CompileState(cfg, report, dumper, list(example_inputs),
                          compat.fake_mode_of(example_inputs, gm))

    original = fx.GraphModule(gm, _copy_graph(gm.graph))
    state.run_passes("dynamo", gm, "dynamo")

    inner_calls: list[str] = []
    dyn_out = gm.graph.output_node().args[0]
    num_user_outputs = len(dyn_out) if isinstance(dyn_out, (list, tuple)) else 1

    def timed_inner(gm_: fx.GraphModule, inputs_: Any, **kwargs: Any) -> Any:
        inner_calls.append("x")
        which = "backward" if kwargs.get("is_backward") else (
            "inference" if kwargs.get("is_inference") else "forward")
        state.current_graph = which
        if dumper:
            dumper.write(f"aot_{which}.py", graph_code(gm_))
        if which == "forward":
            try:
                report.saved_bytes = saved_activation_bytes(gm_, num_user_outputs)
            except Exception as e:  # noqa: BLE001 - accounting is advisory
                report.saved_bytes = {"bytes": 0, "tensors": 0, "error": repr(e)}
        t0 = time.perf_counter()
        passes_before = len(report.passes)
        with compat.inputs_realized_for(realized_for):
            out = compile_fx_inner(gm_, inputs_, **kwargs)
        report.add_time(f"inductor {which}", time.perf_counter() - t0)
        if len(report.passes) == passes_before:
            report.cache_hits.append(which)  # Inductor's FX graph cache answered: no pass ran
        if dumper:
            dumper.write(f"inductor_{which}_code.py", getattr(out, "source_code", None))
            dumper.report(report)  # the backward may compile after the forward ran
        return out

    from torch._inductor import config as inductor_config

    patches = dict(cfg.inductor_patches)
    patches["joint_custom_pre_pass"] = compat.custom_pass_hook_value(
        HCGraphPass("joint", state, patches.get("joint_custom_pre_pass",
                                                inductor_config.joint_custom_pre_pass)))
    patches["post_grad_custom_pre_pass"] = compat.custom_pass_hook_value(
        HCGraphPass("post_grad", state, patches.get("post_grad_custom_pre_pass",
                                                    inductor_config.post_grad_custom_pre_pass)))
    if dumper:
        patches["force_disable_caches"] = True  # a cache hit would skip our passes and dumps
    _choose_inductor_settings(gm, cfg, report, patches, any(
        isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs))
    realized_for = compat.kernel_call_targets() if REALIZED_KERNEL_INPUTS in report.inductor_settings else []

    t0 = time.perf_counter()
    if cfg.compiler == "aot_eager":
        compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
        report.add_time("aot_eager (total)", time.perf_counter() - t0)
        return _finish(report, dumper, compiled)
    try:
        compiled = compile_fx(gm, example_inputs, inner_compile=timed_inner, config_patches=patches)
    except Exception as e:
        if cfg.strict or _is_user_error(e):
            raise
        report.fallback = f"{type(e).__name__}: {e}"
        warnings.warn(f"hccompile: compiling the rewritten graph failed ({report.fallback}); "
                      f"falling back to plain Inductor. Pass strict=True to raise instead.",
                      stacklevel=2)
        log.debug("compile_fx failed", exc_info=True)
        fallback_patches = dict(cfg.inductor_patches)
        if dumper:
            fallback_patches["force_disable_caches"] = True
        compiled = compile_fx(original, example_inputs, config_patches=fallback_patches)
    report.add_time("aot+inductor (total)", time.perf_counter() - t0)
    if not inner_calls:
        report.cache_hits.append("AOTAutograd cache (whole graph)")
    return _finish(report, dumper, compiled)


EXACT_RECOMPUTE_REASON = (
    "hyper-connections found: half-precision intermediates round as eager does, so a value "
    "recomputed in backward equals the saved one bit for bit (block recompute, with dropout, "
    "gives the gradients of no recompute)")


STATIC_LAUNCH_REASON = (
    "hyper-connections found: the mHC kernels are launched by Inductor's static launcher, not by "
    "Triton's Python launcher, whose C module gcc builds for each kernel signature on a fresh cache, "
    "one after another (0.3 s each; the C1024 mHC compile 25.8 s with it against 28.4 s without, "
    "mhc_ and diag_mhc-nostatic_…6a1e516.jsonl); the step's time did not tell the two launchers apart")


REALIZED_KERNEL_INPUTS = "needs_realized_inputs"
SHARED_INPUTS_REASON = (
    "hyper-connections found: a value that one of our kernels reads and other nodes use too is stored "
    "once (hc_realize_kernel_inputs); the mHC stream gradient was written twice by Inductor's sum "
    "kernels and recomputed from two stream-sized inputs by the next h_res^T product (on one H200, "
    "C1024 n4 4 layers: GPU busy 9.32 against 9.60 ms a step, peak 1.18 against 1.30 GiB)")


def _choose_inductor_settings(gm: fx.GraphModule, cfg: HCConfig, report: GraphReport,
                              patches: dict[str, Any], on_cuda: bool) -> None:
    """Inductor settings that follow from what the passes found; the user's options win.

    Recompute rebuilds intermediates inside backward kernels, where Inductor keeps fused float32
    values that the forward stored rounded to bfloat16: measured on the H100, block recompute then
    changed 39 of 42 bf16 gradients of MHCGPT (none with emulate_precision_casts). The setting
    applies to every graph with hyper-connections, whatever hc_recompute says, so that the plans
    compare bit for bit."""
    if gm.meta.get("hc_layers") and compat.has_inductor_option("emulate_precision_casts") \
            and "emulate_precision_casts" not in cfg.inductor_patches:
        patches["emulate_precision_casts"] = True
        report.inductor_settings["emulate_precision_casts"] = (True, EXACT_RECOMPUTE_REASON)
    static = "static_launch_user_defined_triton_kernels"
    if gm.meta.get("hc_layers") and on_cuda and compat.has_inductor_option(static) \
            and static not in cfg.inductor_patches:
        patches[static] = True
        report.inductor_settings[static] = (True, STATIC_LAUNCH_REASON)
    if gm.meta.get("hc_layers") and cfg.hc_realize_kernel_inputs:
        # not a config key: Inductor's registry, extended around compile_fx_inner (compat.inputs_realized_for)
        report.inductor_settings[REALIZED_KERNEL_INPUTS] = ("+ hccompile's kernel calls", SHARED_INPUTS_REASON)


def _finish(report: GraphReport, dumper: Dumper | None, compiled: Any) -> Any:
    log.info("hccompile: %s", report.summary_line())
    for r in report.refusals:
        log.debug("hccompile: refused %s at %s: %s", r["pattern"], r.get("node"), r["reason"])
    if dumper:
        dumper.report(report)
    for collector in getattr(_collect, "stack", []):
        collector.append(report)
    return compiled


def _is_user_error(e: BaseException) -> bool:
    """Errors that plain Inductor would raise too (bad shapes in the user's own code) pass through."""
    # RestartAnalysis is Dynamo asking to trace again (e.g. a global it specialised on), not a failure.
    return isinstance(e, (torch._dynamo.exc.UserError, torch._dynamo.exc.RestartAnalysis))
