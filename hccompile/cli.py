"""`hccompile` console script: demo, doctor, explain, bench, --version.

Bad arguments give one line on stderr (`hccompile <command>: error: ...`) and exit status 2, never
a traceback; `--traceback` shows the traceback of an error raised by the user's model (explain) or
by a run (demo, bench)."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable

from .cli_args import Parser, UsageError, device_arg, positive_int

COMMANDS = {
    "demo": "compile a small model with backend=\"hc\", check it against eager, compare with Inductor",
    "doctor": "versions, GPU, which implementation each op family uses here, known problems",
    "explain": "print what hccompile finds in a model (FILE_OR_MODULE:ATTR), without writing code",
    "bench": "time hccompile's ops against the same math in plain PyTorch on this machine",
}

USAGE = "usage: hccompile [-h] [--version] {" + ",".join(COMMANDS) + "} ..."


def _version_line() -> str:
    import torch

    from . import __version__
    from .kernels._triton import triton

    triton_version = getattr(triton, "__version__", "not installed")
    return f"hccompile {__version__} (torch {torch.__version__}, Triton {triton_version}, Python " \
           f"{sys.version.split()[0]})"


def _top_help() -> str:
    width = max(map(len, COMMANDS))
    lines = [USAGE, "", "A torch.compile backend: torch.compile(model, backend=\"hc\").", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    lines += ["", "options:", "  -h, --help  show this help and exit", "  --version   print the versions and exit",
              "", "hccompile COMMAND --help describes each command."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# doctor


def doctor_main(argv: list[str]) -> int:
    from . import doctor

    p = Parser(prog="hccompile doctor", description=doctor.__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the facts and checks as JSON instead")
    a = p.parse_args(argv)
    if a.json:
        import json

        checks, facts = doctor.gather()
        print(json.dumps({"facts": facts, "checks": [vars(c) for c in checks]}, indent=2, default=str))
        return 1 if any(c.status == "FAIL" for c in checks) else 0
    return doctor.main()


# ----------------------------------------------------------------------------------------
# explain

EXPLAIN_HELP = """\
Compile a model with backend="hc" on example inputs and print the report: the patterns each pass
matched and lowered, the candidates it refused and why, the ops that reached the forward and
backward graphs, and the compile times (hccompile.explain; docs/dumps.md).

FILE_OR_MODULE:ATTR is FILE.py:ATTR or package.module:ATTR. The example inputs come from one of:

  1. a function named `example_inputs` (or --inputs NAME) in the same file or module, called with
     no arguments, returning a tuple of positional inputs (or a dict of keyword inputs); ATTR is
     then the model: an nn.Module instance, an nn.Module class (instantiated with no arguments)
     or a plain function;
  2. otherwise ATTR itself is a factory: called with no arguments it returns (model, inputs), inputs
     a tuple of positional inputs (or a dict of keyword inputs).

The file is imported as a module named after it (its directory goes on sys.path), so its
top-level code runs. The backward is compiled too unless --no-backward.

example (my_model.py):

    import torch

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.tril(q @ k.transpose(-2, -1)) @ v

    def example_inputs():
        return tuple(torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))

    hccompile explain my_model.py:Attn
"""


def _load_module(spec: str):
    """Import FILE.py or a dotted module name; UsageError with one line when it cannot be."""
    looks_like_file = spec.endswith(".py") or os.sep in spec or "/" in spec
    if looks_like_file:
        path = os.path.abspath(spec)
        if not os.path.isfile(path):
            raise UsageError(f"no such file: {spec}")
        name = os.path.splitext(os.path.basename(path))[0]
        if not name.isidentifier():
            name = "_hccompile_target"
        directory = os.path.dirname(path)
        if directory not in sys.path:
            sys.path.insert(0, directory)
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise UsageError(f"cannot load {spec} as Python")
        module = importlib.util.module_from_spec(module_spec)
        # in sys.modules before it runs: Dynamo and pickling look functions up by module name
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
        return module
    if not all(part.isidentifier() for part in spec.split(".")):
        raise UsageError(f"not a file or module name: {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name and spec.startswith(e.name):
            raise UsageError(f"no module named {e.name!r} (a file needs its .py suffix)") from None
        raise


def resolve_target(target: str, inputs_name: str = "example_inputs") -> tuple[Any, tuple, dict]:
    """(model, args, kwargs) for TARGET, following EXPLAIN_HELP's two conventions."""
    import torch

    spec, sep, attr = target.rpartition(":")
    if not sep or not spec or not attr:
        raise UsageError(f"expected FILE.py:ATTR or module:ATTR, got {target!r}")
    module = _load_module(spec)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{spec} has no attribute {attr!r}")
        obj = getattr(obj, part)
    make_inputs = getattr(module, inputs_name, None)
    if make_inputs is not None:
        if not callable(make_inputs):
            raise UsageError(f"{spec}:{inputs_name} is not a function")
        model = obj() if isinstance(obj, type) and issubclass(obj, torch.nn.Module) else obj
        inputs = make_inputs()
        where = f"{spec}:{inputs_name}()"
    else:
        if not callable(obj) or isinstance(obj, torch.nn.Module):
            raise UsageError(f"{spec} defines no {inputs_name}(), so {attr} must be a factory returning "
                             f"(model, inputs); see hccompile explain --help")
        made = obj()
        if not (isinstance(made, (tuple, list)) and len(made) == 2):
            raise UsageError(f"{spec}:{attr}() returned {type(made).__name__}, not (model, inputs); "
                             f"or define {inputs_name}() beside the model")
        model, inputs = made
        where = f"{spec}:{attr}()"
    if isinstance(inputs, dict):
        args, kwargs = (), inputs
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    elif isinstance(inputs, torch.Tensor):
        args, kwargs = (inputs,), {}
    else:
        raise UsageError(f"{where} gave {type(inputs).__name__}: expected a tuple of inputs or a dict")
    if not callable(model):
        raise UsageError(f"the model from {target} is a {type(model).__name__}, not callable")
    return model, args, kwargs


def _option_value(text: str) -> tuple[str, Any]:
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value  # a bare word: a string
    return key.strip(), parsed


def explain_main(argv: list[str]) -> int:
    p = Parser(prog="hccompile explain", description=EXPLAIN_HELP,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="FILE_OR_MODULE:ATTR", help="the model (see above)")
    p.add_argument("--inputs", default="example_inputs", metavar="NAME",
                   help="name of the example-inputs function beside the model (default: example_inputs)")
    p.add_argument("--option", "-o", action="append", type=_option_value, default=[], metavar="KEY=VALUE",
                   help="a backend option (docs/options.md), repeatable; VALUE is a Python literal or a word, "
                        "e.g. -o strict=True -o disable_passes=['linear_attn']")
    p.add_argument("--mode", default=None, help="torch.compile mode, as for backend=\"inductor\"")
    p.add_argument("--no-backward", action="store_true", help="compile the forward only")
    p.add_argument("--dynamic", action="store_true", help="compile with dynamic shapes (torch.compile(dynamic=True))")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of markdown")
    p.add_argument("--dump-dir", default=None, help="also write the dumps (docs/dumps.md) here")
    p.add_argument("--traceback", action="store_true", help="show the traceback when loading or compiling fails")
    a = p.parse_args(argv)
    options = dict(a.option)
    if a.dump_dir:
        options["dump_dir"] = a.dump_dir
    if a.mode and options:
        p.error("--mode and --option/--dump-dir cannot be combined (torch.compile takes mode= or options=)")
    try:
        model, args, kwargs = resolve_target(a.target, a.inputs)
    except UsageError as e:
        p.error(str(e))
    except Exception as e:  # noqa: BLE001 - the user's file failed: one line unless asked
        return _fail("hccompile explain", f"loading {a.target} failed", e, a.traceback)
    import contextlib

    from .compat import quiet_fake_tensor_errors
    from .explain import explain

    try:
        # one line for a failure, as the user asked (torch 2.15 would log its traceback first)
        with contextlib.nullcontext() if a.traceback else quiet_fake_tensor_errors():
            report = explain(model, *args, options=options or None, mode=a.mode, backward=not a.no_backward,
                             dynamic=True if a.dynamic else None, **kwargs)
    except Exception as e:  # noqa: BLE001
        return _fail("hccompile explain", "compiling failed", e, a.traceback)
    if a.json:
        import json

        print(json.dumps(report.to_json(), indent=2, default=repr))
    else:
        print(report.to_markdown())
    return 0


def _fail(prog: str, what: str, error: BaseException, traceback: bool) -> int:
    if traceback:
        raise error
    message = str(error).strip().splitlines()
    first = message[0] if message else ""
    print(f"{prog}: {what}: {type(error).__name__}: {first} (--traceback for the traceback)", file=sys.stderr)
    return 1


# ----------------------------------------------------------------------------------------
# bench


def bench_main(argv: list[str]) -> int:
    from . import bench

    p = Parser(prog="hccompile bench", description=bench.__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(bench.OPS),
                   help=f"comma-separated op families, of {', '.join(bench.OPS)} (default: all)")
    p.add_argument("--device", type=device_arg, default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="input dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--batch", type=positive_int, default=None, help="B (default: 2 on CUDA, 1 on the CPU)")
    p.add_argument("--seq", type=positive_int, default=None, help="T (default: 1024 on CUDA, 128 on the CPU)")
    p.add_argument("--heads", type=positive_int, default=None, help="H (default: 8 on CUDA, 2 on the CPU)")
    p.add_argument("--dim", type=positive_int, default=None,
                   help="head dim D, at most 256 (default: 64 on CUDA, 32 on the CPU)")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="timed calls per row, after one warm-up (default: 5 on CUDA, 3 on the CPU)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results to FILE as JSON")
    p.add_argument("--traceback", action="store_true", help="show the traceback when a run fails")
    a = p.parse_args(argv)
    ops = [op.strip() for op in a.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in bench.OPS]
    if unknown or not ops:
        p.error(f"--ops: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(bench.OPS)}")
    if a.dim is not None and a.dim > 256:
        p.error(f"--dim: at most 256 (the kernels' head-dim limit), got {a.dim}")
    if a.dim is not None and a.dim % 2 and "htree" in ops:
        p.error(f"--dim: htree needs an even head dim (RoPE), got {a.dim}")
    if a.json and os.path.isdir(a.json):
        p.error(f"--json: {a.json} is a directory")
    try:
        result = bench.run(ops, device=a.device, dtype=a.dtype, batch=a.batch, seq=a.seq, heads=a.heads,
                           dim=a.dim, iters=a.iters)
    except Exception as e:  # noqa: BLE001
        return _fail("hccompile bench", "a run failed", e, a.traceback)
    print(bench.table(result))
    if a.json:
        bench.dump_json(result, a.json)
    return 0


# ----------------------------------------------------------------------------------------


def _demo_main(argv: list[str]) -> int:
    from .demo import main as demo_main

    return demo_main(argv)


HANDLERS: dict[str, Callable[[list[str]], int]] = {
    "demo": _demo_main, "doctor": doctor_main, "explain": explain_main, "bench": bench_main,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(_top_help(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_top_help())
        return 0
    if argv[0] == "--version":
        print(_version_line())
        return 0
    cmd, rest = argv[0], argv[1:]
    handler = HANDLERS.get(cmd)
    if handler is None:
        print(f"hccompile: error: unknown command {cmd!r}; choose from {', '.join(COMMANDS)} "
              f"(see hccompile --help)", file=sys.stderr)
        return 2
    try:
        return handler(rest)
    except KeyboardInterrupt:
        print(f"hccompile {cmd}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `hccompile doctor | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
