"""hccompile's options: one table, validated, settable by `options=` or by environment variable.

Precedence: `options=` > environment variable > default. Any key that is not one of ours must be a
`torch._inductor.config` key (as with `backend="inductor"`); anything else is an error that lists the
valid options.
"""
from __future__ import annotations

import dataclasses
import os
import types
from typing import Any, Callable

ENV_PREFIX = "HCCOMPILE_"


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    default: Any
    kind: type | tuple[type, ...]
    doc: str
    env: str = ""
    parse: Callable[[str], Any] | None = None
    check: Callable[[Any], str | None] | None = None  # returns an error message or None


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {text!r}")


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _check_pass_names(value: Any) -> str | None:
    from .passes import all_pass_names

    unknown = sorted(set(value) - set(all_pass_names()))
    if unknown:
        return f"unknown pass name(s) {unknown}; known passes: {sorted(all_pass_names())}"
    return None


def _check_probe_tolerance(value: Any) -> str | None:
    return None if 0 < value < 1 else f"must be in (0, 1), got {value}"


def _option(default: Any, doc: str, env: str, parse: Callable[[str], Any] | None = None,
            check: Callable[[Any], str | None] | None = None, accepts: tuple[type, ...] = ()) -> Any:
    """A field of Options: its default, its doc (docs/options.md), its environment variable, how
    to parse that, a check of the value, and input types beyond the field's own (converted)."""
    return dataclasses.field(default=default, metadata={"doc": doc, "env": env, "parse": parse, "check": check,
                                                       "accepts": accepts})


def _check_choice(*choices: str) -> Callable[[Any], str | None]:
    named = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"

    def check(value: Any) -> str | None:
        return None if value in choices else f"must be {named}, got {value!r}"
    return check


@dataclasses.dataclass(frozen=True)
class Options:
    """hccompile's options, typed: `torch.compile(model, backend="hc", options={...})` fills one,
    validated by resolve(); passes read them as `ctx.config.<name>`."""

    dump_dir: str | None = _option(
        None, "Write per-graph dumps (pass graphs before/after, report.json, report.md, depyf sources, AOT "
        "and Inductor graphs) under this directory. Disables Inductor's caches.",
        env="HCCOMPILE_DUMP", parse=str, accepts=(os.PathLike,))
    strict: bool = _option(
        False, "Re-raise when one of our passes fails instead of falling back to plain Inductor.",
        env="HCCOMPILE_STRICT", parse=_parse_bool)
    disable_passes: tuple[str, ...] = _option(
        (), "Names of hccompile passes to skip (see `hccompile.passes.all_pass_names()`).",
        env="HCCOMPILE_DISABLE_PASSES", parse=_parse_list, check=_check_pass_names, accepts=(list,))
    probe: bool = _option(
        True, "Verify every matched candidate numerically on random probe inputs at compile time before "
        "replacing it; a mismatch refuses the candidate.",
        env="HCCOMPILE_PROBE", parse=_parse_bool)
    probe_tolerance: float = _option(
        2e-2, "Relative RMS error under which a low-precision (fp16/bf16) probe counts as a match; fp32/fp64 "
        "probes use 1e-4.",
        env="HCCOMPILE_PROBE_TOLERANCE", parse=float, check=_check_probe_tolerance)
    compiler: str = _option(
        "inductor", "What compiles the rewritten graph: 'inductor' (default), or 'aot_eager' (our Dynamo-stage "
        "passes, then AOTAutograd with no code generation; for bisecting bugs; joint and post-grad passes do "
        "not run).",
        env="HCCOMPILE_COMPILER", parse=str, check=_check_choice("inductor", "aot_eager"))
    hc_recompute: str = _option(
        "block", "mHC recompute plan: 'block' keeps each block's input stream and every sublayer output and "
        "rebuilds all hyper-connection intermediates in backward; 'layer' does the same per sublayer; 'off' "
        "leaves the plan to the partitioner.",
        env="HCCOMPILE_HC_RECOMPUTE", parse=str, check=_check_choice("block", "layer", "off"))
    hc_recompute_block: int | None = _option(
        None, "Sublayers per recompute block; None uses the paper's L_r* = round(sqrt(n*L/(n+2))).",
        env="HCCOMPILE_HC_RECOMPUTE_BLOCK", parse=int,
        check=lambda v: None if v is None or v >= 1 else f"must be >= 1, got {v}")
    hc_recompute_include_norm: bool = _option(
        True, "Also rebuild each sublayer's input norm (the norm applied to the aggregate) in backward instead "
        "of saving its output.",
        env="HCCOMPILE_HC_RECOMPUTE_INCLUDE_NORM", parse=_parse_bool)
    hc_recompute_include_activation: bool = _option(
        True, "Also rebuild each sublayer's elementwise activations (an MLP's GELU or SiLU) in backward from "
        "their input, which the backward keeps anyway, instead of saving both.",
        env="HCCOMPILE_HC_RECOMPUTE_INCLUDE_ACTIVATION", parse=_parse_bool)
    hc_recompute_include_bda: bool = _option(
        True, "Rebuild the residual (bias-dropout-add) outputs inside a block; False saves each sublayer's "
        "output stream.",
        env="HCCOMPILE_HC_RECOMPUTE_INCLUDE_BDA", parse=_parse_bool)
    hc_realize_kernel_inputs: bool = _option(
        True, "Graphs with hyper-connections: a value with several users, one of them one of our kernels (which "
        "reads it from memory anyway), is stored once where it is computed and its other users read it, instead "
        "of computing it again from its inputs (Inductor does this for matmul inputs). The mHC stream gradient "
        "feeds the post backward kernel and the next h_res^T product: without this, Inductor writes it twice "
        "and reads two stream-sized inputs for one (one H200, C1024 n4: GPU 9.32 against 9.60 ms a step).",
        env="HCCOMPILE_HC_REALIZE_KERNEL_INPUTS", parse=_parse_bool)
    depyf: bool = _option(
        True, "With dump_dir: also write depyf's decompiled Dynamo bytecode.",
        env="HCCOMPILE_DEPYF", parse=_parse_bool)


def _kinds(hint: Any) -> tuple[type, ...]:
    """The runtime types of a field's annotation: `str | None` -> (str, NoneType), tuple[str, ...] -> (tuple,)."""
    import typing

    parts = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return tuple(typing.get_origin(p) or p for p in parts)


def _options_table() -> dict[str, Option]:
    import typing

    hints = typing.get_type_hints(Options)
    table = {}
    for f in dataclasses.fields(Options):
        m = f.metadata
        kinds = _kinds(hints[f.name]) + m["accepts"]
        table[f.name] = Option(f.name, f.default, kinds if len(kinds) > 1 else kinds[0], m["doc"], env=m["env"],
                               parse=m["parse"], check=m["check"])
    return table


# name -> Option: what resolve() validates and docs/options.md lists, read off Options' fields
OPTIONS: dict[str, Option] = _options_table()


class OptionError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class HCConfig:
    """Resolved hccompile options plus the Inductor config patches to apply. `cfg.strict` and the
    like read the typed Options (`cfg.options`)."""

    options: Options
    inductor_patches: dict[str, Any]
    mode: str | None = None

    def __getattr__(self, name: str) -> Any:
        if name in OPTIONS:
            return getattr(object.__getattribute__(self, "options"), name)
        raise AttributeError(name)

    @property
    def values(self) -> dict[str, Any]:
        """The options by name (a copy)."""
        return {name: getattr(self.options, name) for name in OPTIONS}

    def as_dict(self) -> dict[str, Any]:
        return {**self.values, "mode": self.mode, "inductor": dict(self.inductor_patches)}


def _inductor_config_keys() -> dict[str, Any]:
    from torch._inductor import config as inductor_config

    return inductor_config.get_config_copy()


def _is_inductor_attr(dotted: str) -> bool:
    """Keys like force_disable_caches are settable config entries missing from get_config_copy()."""
    from torch._inductor import config as inductor_config

    obj: Any = inductor_config
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return not callable(obj) or isinstance(obj, bool)


def _coerce(opt: Option, value: Any, source: str) -> Any:
    if opt.kind is bool and isinstance(value, int) and not isinstance(value, bool):
        value = bool(value)
    if opt.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, opt.kind):
        raise OptionError(
            f"hccompile option {opt.name!r} ({source}): expected {_kind_name(opt.kind)}, "
            f"got {type(value).__name__} {value!r}"
        )
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if opt.check is not None:
        err = opt.check(value)
        if err:
            raise OptionError(f"hccompile option {opt.name!r} ({source}): {err}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def resolve(options: dict[str, Any] | None = None, mode: str | None = None,
            environ: dict[str, str] | None = None) -> HCConfig:
    """Validate `options=` and the environment; split ours from Inductor's."""
    environ = os.environ if environ is None else environ
    options = dict(options or {})
    values: dict[str, Any] = {}
    for name, opt in OPTIONS.items():
        if name in options:
            values[name] = _coerce(opt, options.pop(name), "options=")
        elif opt.env and opt.env in environ:
            raw = environ[opt.env]
            try:
                parsed = opt.parse(raw) if opt.parse else raw
            except ValueError as e:
                raise OptionError(f"environment variable {opt.env}={raw!r}: {e}") from None
            values[name] = _coerce(opt, parsed, f"env {opt.env}")
        else:
            values[name] = opt.default

    inductor_keys = _inductor_config_keys()
    patches: dict[str, Any] = {}
    if mode is not None and mode != "default":
        from torch._inductor import list_mode_options

        modes = list_mode_options()
        if mode not in modes:
            raise OptionError(f"mode={mode!r} is not one of {sorted(modes)}")
        patches.update(list_mode_options(mode))
    for key, val in options.items():
        attr = key.replace("-", "_")
        if attr not in inductor_keys and not _is_inductor_attr(attr):
            raise OptionError(
                f"unknown option {key!r}. hccompile options: {sorted(OPTIONS)}; any "
                f"torch._inductor.config key is accepted too (e.g. 'max_autotune', "
                f"'triton.cudagraphs', 'epilogue_fusion')."
            )
        patches[attr] = val
    return HCConfig(options=Options(**values), inductor_patches=patches, mode=mode)


def options_table_markdown() -> str:
    """The options table for docs/options.md (kept in sync by a test)."""
    rows = ["| option | env var | default | meaning |", "|---|---|---|---|"]
    for opt in OPTIONS.values():
        rows.append(f"| `{opt.name}` | `{opt.env}` | `{opt.default!r}` | {opt.doc} |")
    return "\n".join(rows)
