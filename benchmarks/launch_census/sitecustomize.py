"""Triton interpreter launches per test, for checking what a test selection launches (the Makefile's
test-triton-oldest selection was narrowed on this record). Put this folder first on PYTHONPATH with
LAUNCH_LOG_DIR set; Python imports it as sitecustomize in every process, the CP ranks included (they
inherit PYTEST_CURRENT_TEST, so their launches count for the test that started them):

    mkdir -p /tmp/launches && make test-triton-oldest PYTHONPATH=$PWD/benchmarks/launch_census \
        LAUNCH_LOG_DIR=/tmp/launches

Each process appends to LAUNCH_LOG_DIR/<pid>.jsonl one line per distinct record: a launch (kernel,
its constexpr values, each other argument's kind: a tensor's dtype, None, int, float) or a call of a
@triton.jit device function from a kernel.
"""
import os
if os.environ.get("LAUNCH_LOG_DIR"):
    import json
    from triton.runtime import interpreter as _interp

    _seen = set()
    _path = os.path.join(os.environ["LAUNCH_LOG_DIR"], f"{os.getpid()}.jsonl")

    def _test():
        t = os.environ.get("PYTEST_CURRENT_TEST", "?")
        return t.rsplit(" (", 1)[0]

    def _describe(v):
        if v is None:
            return "None"
        dt = getattr(v, "dtype", None)
        if dt is not None and hasattr(v, "data_ptr"):
            return f"tensor:{dt}"
        if isinstance(v, bool):
            return f"bool:{v}"
        if isinstance(v, int):
            return "int"
        if isinstance(v, float):
            return "float"
        return type(v).__name__

    def _emit(rec):
        k = json.dumps(rec, sort_keys=True, default=str)
        if k in _seen:
            return
        _seen.add(k)
        with open(_path, "a") as f:
            f.write(k + "\n")

    _orig_run = _interp.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            fn = self.fn
            ann = getattr(fn, "__annotations__", {})
            names = self.arg_names
            bound = dict(zip(names, args))
            bound.update(kwargs)
            const = {n: repr(bound.get(n)) for n in names if "constexpr" in str(ann.get(n, "")) and n in bound}
            other = {n: _describe(bound[n]) for n in names if n in bound and n not in const}
            _emit({"test": _test(), "kind": "launch", "kernel": f"{fn.__module__}.{fn.__qualname__}",
                   "constexpr": const, "args": other, "ranked": os.environ.get("RANK")})
        except Exception as e:  # never break a test
            _emit({"test": _test(), "kind": "error", "error": repr(e)})
        return _orig_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    _interp.InterpretedFunction.run = run
    _orig_call = _interp.InterpretedFunction.__call__
    _called = set()

    def __call__(self, *args, **kwargs):
        key = (_test(), self.fn)
        if key not in _called:
            _called.add(key)
            _emit({"test": key[0], "kind": "call", "kernel": f"{self.fn.__module__}.{self.fn.__qualname__}",
                   "ranked": os.environ.get("RANK")})
        return _orig_call(self, *args, **kwargs)

    _interp.InterpretedFunction.__call__ = __call__
