"""Library functions that Dynamo would unroll, traced as one hccompile op when hc is the backend.

HF transformers' plain-PyTorch delta rules loop over chunks in Python (hccompile.nn's plain chunked
forms too; MiniMax's lightning layer loops over blocks inside its forward method). Dynamo unrolls such a loop,
and its trip count pins the sequence length: every new length is a new graph, and compile time
grows with T (on the H100, 144 s at T=2048 and 266 s at T=4096 for Kimi-Linear's KDA layer). The
pass layer can still match the unrolled loop, but only after Dynamo has specialised T. For the
functions listed in `clients.py` (a function, or a method as "Class.method"), hc asks Dynamo to
trace a substitute that calls our op (`torch._dynamo.substitute_in_graph`): one graph for every T,
compiled in seconds.

Two rules keep this honest:
- Only under hc. The substitute asks, at trace time, which backend the frame is traced for (a call
  Dynamo folds to a constant; compat.tracing_backend). Any other backend traces the original code,
  and so does hc with `disable_passes=("substitutes",)`.
- Proven, not assumed. The first time a configuration is traced (heads, head dims, chunk size,
  flags), the original function and the op's token-by-token reference run on the CPU on random
  float32 inputs of that configuration; they must agree within PROBE_TOLERANCE (relative RMS of the
  output and of the final state). A release of the library whose signature or math differs is
  traced as written, and the report says why. A call the substitute does not cover (an option, a
  cache) is traced as written too, with the reason (`decline`).

Every decision (substituted, with the probe's error, or not, with the reason) goes into the report
of the graph being traced (the `substitutes` pass drains them).
"""
from __future__ import annotations

import dataclasses
import importlib.abc
import inspect
import sys
import threading
import types
from typing import Any, Callable

import torch

from .. import compat

PROBE_TOLERANCE = 1e-4  # float32 against float32: the chunked and token-by-token forms differ by ~1e-6
PASS_NAME = "substitutes"
_REQUIRED = object()  # a parameter without a default


@dataclasses.dataclass(frozen=True)
class Client:
    """One library function: where it lives (`attribute` may be dotted, "Class.method", for a
    method), the parameters (name, default) it must have, and how to build its substitute from a
    callable copy of the original and the client's name."""

    module: str
    attribute: str
    parameters: tuple[tuple[str, Any], ...]
    make_substitute: Callable[[Callable[..., Any], str], Callable[..., Any]]
    probe: Callable[..., float]

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"


_CLIENTS: dict[str, list[Client]] = {}
_installed: dict[str, str] = {}  # client name -> "substituted" or the reason it was not
_originals: dict[str, Any] = {}  # client name -> the function substituted (what the probe runs)
_probes: dict[tuple, tuple[bool, str, float | None]] = {}
_decisions = threading.local()
_lock = threading.RLock()


def register(client: Client) -> None:
    with _lock:
        _CLIENTS.setdefault(client.module, []).append(client)
        module = sys.modules.get(client.module)
        if module is not None:
            _install(client, module)


def installed() -> dict[str, str]:
    """Each known client function whose module was imported: "substituted", or why not."""
    return dict(_installed)


def _raw_function(obj: Any) -> Any:
    # HF decorates these functions (hub kernels); Dynamo inlines the wrappers and then calls the
    # innermost function, which is the one to substitute.
    return inspect.unwrap(obj) if callable(obj) else obj


def _signature_matches(fn: Any, parameters: tuple[tuple[str, Any], ...]) -> str | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        return f"no signature ({e})"
    named = [(p.name, p.default) for p in sig.parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    expected = [(n, inspect.Parameter.empty if d is _REQUIRED else d) for n, d in parameters]
    if named != expected:
        return f"signature {sig} is not the one this substitute was written for"
    return None


def required(*names: str) -> tuple[tuple[str, Any], ...]:
    return tuple((n, _REQUIRED) for n in names)


def _copy(fn: types.FunctionType) -> types.FunctionType:
    """The same code as a new function object: Dynamo traces it as written (the original itself
    would be substituted again)."""
    clone = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = fn.__kwdefaults__
    clone.__qualname__ = fn.__qualname__
    return clone


def _lookup(module: types.ModuleType, attribute: str) -> Any:
    obj: Any = module
    for name in attribute.split("."):
        obj = getattr(obj, name, None)
    return obj


def _install(client: Client, module: types.ModuleType) -> None:
    if client.name in _installed:
        return
    fn = _raw_function(_lookup(module, client.attribute))
    if not isinstance(fn, types.FunctionType):
        _installed[client.name] = f"{client.attribute} is not a Python function in this release"
        return
    mismatch = _signature_matches(fn, client.parameters)
    if mismatch:
        _installed[client.name] = mismatch
        return
    from torch._dynamo.decorators import substitute_in_graph

    substitute = client.make_substitute(_copy(fn), client.name)
    substitute_in_graph(fn, skip_signature_check=True)(substitute)
    _originals[client.name] = fn
    _installed[client.name] = "substituted"


# --- the trace-time decision -----------------------------------------------------------------------
def _hc_options() -> dict[str, Any] | None:
    """hc's options when the frame being traced is compiled by hc, else None."""
    found = compat.tracing_backend()
    if found is None:
        return None
    fn, kwargs = found
    if getattr(fn, "__hccompile_backend__", False):
        # resolved options: on a backend object (tests' Collect) or bound by partial (explain)
        cfg = getattr(fn, "cfg", None) or kwargs.get("cfg")
        if cfg is not None:
            return dict(cfg.values)
        return dict(kwargs.get("options") or {})
    return None


def _record(decision: dict[str, Any]) -> None:
    pending = getattr(_decisions, "pending", None)
    if pending is None:
        pending = _decisions.pending = []
    if decision not in pending:
        pending.append(decision)


def take_decisions() -> list[dict[str, Any]]:
    """The decisions made while tracing the frame whose graph is compiled now (this thread)."""
    pending = getattr(_decisions, "pending", None) or []
    _decisions.pending = []
    return pending


def _applies() -> bool:
    """Whether the frame being traced is compiled by hc with the substitutions on."""
    options = _hc_options()
    return options is not None and PASS_NAME not in tuple(options.get("disable_passes", ()) or ())


def _decide(client: str, *config: Any) -> bool:
    if not _applies():
        return False
    key = (client, *config)
    with _lock:
        if key not in _probes:
            _probes[key] = _run_probe(client, config)
    ok, reason, error = _probes[key]
    _record({"client": client, "config": config, "error": error, "substituted": ok, "reason": reason})
    return ok


def _run_probe(client_name: str, config: tuple) -> tuple[bool, str, float | None]:
    client = next((c for cs in _CLIENTS.values() for c in cs if c.name == client_name), None)
    if client is None or client_name not in _originals:
        return False, "unknown client", None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily(), torch.no_grad(), torch.random.fork_rng(devices=[]):
            error = client.probe(_originals[client_name], *config)
    except Exception as e:  # noqa: BLE001 - a probe that cannot run refuses the substitution
        return False, f"probe failed: {type(e).__name__}: {e}", None
    if not error < PROBE_TOLERANCE:  # NaN refuses too
        return False, f"original and op differ: relative RMS {error:.2e} >= {PROBE_TOLERANCE:.0e}", error
    return True, "equal to the original on the probe", error


def use_substitute(client: str, *config: Any) -> bool:
    """Called by the substitutes with the client's name and its static configuration (ints,
    bools). Dynamo folds the call at trace time (its arguments are constants); when one is not
    (a symbolic head count), the traceable stand-in below runs instead and answers False, and
    nothing is reported. A substitute that must decide on sizes of a compiled function's own inputs
    (symbols under dynamic=True) fixes them first with operator.index (clients.py, hccompile.nn's)."""
    return _decide(client, *config)


def _use_substitute_traced(client: str, *config: Any) -> bool:
    return False


def decline(client: str, reason: str, *config: Any) -> None:
    """Called by a substitute that traces the original because the call uses something the
    substitute does not cover (an option, a cache): the reason goes into the report as a refusal,
    under hc only. Folded by Dynamo at trace time like use_substitute (the traceable stand-in
    records nothing when an argument is not a constant)."""
    if _applies():
        _record({"client": client, "config": config, "error": None, "substituted": False, "reason": reason})


def _decline_traced(client: str, reason: str, *config: Any) -> None:
    return None


def _register_decision_fold() -> None:
    from torch._dynamo.decorators import substitute_in_graph

    substitute_in_graph(use_substitute, can_constant_fold_through=True,
                        skip_signature_check=True)(_use_substitute_traced)
    substitute_in_graph(decline, can_constant_fold_through=True, skip_signature_check=True)(_decline_traced)


# --- installing for modules imported later ---------------------------------------------------------
class _AfterImport(importlib.abc.MetaPathFinder):
    """Installs the substitutes of a client module right after that module is imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _CLIENTS or fullname in sys.modules:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_install(module):
            exec_module(module)
            with _lock:
                for client in _CLIENTS.get(fullname, ()):
                    _install(client, module)

        loader.exec_module = exec_and_install
        return spec


_hook = _AfterImport()


def install() -> None:
    """Registers the known clients (each installed now if its module is imported, else on import)."""
    from . import clients  # noqa: F401  (registers)

    with _lock:
        if _hook not in sys.meta_path:
            sys.meta_path.insert(0, _hook)


_register_decision_fold()
