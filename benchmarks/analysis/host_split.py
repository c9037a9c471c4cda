"""Where one eager fwd+bwd's host time goes (issue 24): each part timed behind a long GPU sleep, so
the queue never drains and the clock reads the CPU alone.

    python benchmarks/analysis/host_split.py --ops lightning,gdn --shape B4T4096H16D128

Parts: the whole step, through hccompile's eager Launcher (kernels/launcher.py) and through plain
JITFunction.run launches; the forward alone (no autograd); Triton's launch path, counted by wrapping
JITFunction.run (its share of the step and its count); a bare launch of a small Triton kernel with
the same number of arguments as the op's widest, and the same kernel through its compiled launcher
alone (the floor of a launch from Python); torch.empty. cProfile inflates small Python calls,
so these are plain clocks.

Without a GPU, `--stub` times the same parts on CPU tensors with every launch stubbed out (Triton's
interpreter, its kernel runs replaced by a counter): what is left is our Python, torch's dispatch
and the autograd engine, the host work a launch-free step still does:

    TRITON_INTERPRET=1 python benchmarks/analysis/host_split.py --stub --ops lightning
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import bthd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


DEVICE = "cuda"


def host_ms(fn, steps: int = 50) -> float:
    for _ in range(3):
        fn()
    if DEVICE != "cuda":
        started = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - started) / steps * 1e3
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))
    started = time.perf_counter()
    for _ in range(steps):
        fn()
    elapsed = (time.perf_counter() - started) / steps * 1e3
    torch.cuda.synchronize()
    return elapsed


class LaunchClock:
    """Wraps triton's JITFunction.run: counts launches, their argument counts and the time inside."""

    def __init__(self, stub: bool = False):
        import triton.runtime.jit as jit

        if stub:  # the interpreter's kernels, whose runs do nothing but count
            import triton.runtime.interpreter as interpreter

            self.jit, self.original = interpreter, None
            self.cls = interpreter.InterpretedFunction
        else:
            self.jit, self.original, self.cls = jit, jit.JITFunction.run, jit.JITFunction
        self.restore = self.cls.run
        self.seconds, self.count, self.widest, self.names = 0.0, 0, 0, {}
        clock = self

        def run(fn_self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return None if clock.original is None else clock.original(fn_self, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - started
                clock.count += 1
                clock.widest = max(clock.widest, len(args) + len(kwargs))
                name = getattr(getattr(fn_self, "fn", fn_self), "__name__", str(fn_self))
                clock.names[name] = clock.names.get(name, 0) + 1

        self.cls.run = run

    def reset(self):
        self.seconds, self.count, self.names = 0.0, 0, {}

    def close(self):
        self.cls.run = self.restore


def bare_launch_fn(num_args: int, wrap=lambda kernel: kernel):
    """A Triton kernel of `num_args` arguments (tensors and ints, like ours), launched on a tiny grid
    through `wrap(kernel)` (hccompile.kernels.launcher.launcher: our eager launch path)."""
    names = [f"a{i}" for i in range(num_args - 2)]
    source = (f"def _bare_kernel(x_ptr, {', '.join(names)}, N: tl.constexpr):\n"
              f"    i = tl.arange(0, N)\n    tl.store(x_ptr + i, tl.load(x_ptr + i) + 1.0)\n")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"_bare_kernel_{num_args}.py")
    with open(path, "w") as f:
        f.write("import triton\nimport triton.language as tl\n\n@triton.jit\n" + source)
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_bare_kernel_{num_args}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = torch.zeros(16, device=DEVICE)
    extra = [x if i % 3 == 0 else 7 + i for i in range(num_args - 2)]
    launch = wrap(module._bare_kernel)
    return lambda: launch[(1,)](x, *extra, N=16)


def compiled_launch_fn(num_args: int):
    """The same kernel launched through its CompiledKernel's launcher directly, with what
    JITFunction.run computes per call (binding, specialisation key, cache lookup, stream, launch
    metadata) done once: the floor of a launch from Python, hence what a launch path that skips
    JITFunction.run could save (issue 20/24). None where this Triton's launcher takes other arguments."""
    launch = bare_launch_fn(num_args)
    kernel = launch()  # JITFunction.run returns the compiled kernel
    x = torch.zeros(16, device=DEVICE)
    extra = [x if i % 3 == 0 else 7 + i for i in range(num_args - 2)]
    stream = torch.cuda.current_stream().cuda_stream
    args = (x, *extra, 16)

    def run():
        kernel.run(1, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)
    try:
        run()
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 (a diagnostic: say so and go on)
        print(f"compiled launch: not measured on this Triton ({type(error).__name__}: {error})", flush=True)
        return None
    return run


def lightning_parts(shape, decayed: bool = True):
    """decayed=False: the log-decays all zero (op "lightning-nodecay"), as benchmarks/lightning.py's
    rows without decay, which measured slower than with decay on the same kernels (session 39)."""
    import hccompile
    from hccompile.kernels.lightning.chunk import lightning_attn_bwd, lightning_attn_fwd
    from hccompile.lowering.lightning import alibi_decay

    B, T, H, D = shape
    q, k, v = (torch.randn(B, T, H, D, device=DEVICE).bfloat16().requires_grad_() for _ in range(3))
    decay = alibi_decay(H, device=DEVICE) if decayed else torch.zeros(H, device=DEVICE)
    do = torch.randn(B, T, H, D, device=DEVICE).bfloat16()
    d = decay.float().contiguous()

    def step():
        torch.autograd.backward(hccompile.lightning_attn(q, k, v, decay=decay)[0], do)

    def forward_op():
        with torch.no_grad():
            hccompile.lightning_attn(q, k, v, decay=decay)

    from hccompile.lowering.lightning import _lightning_attn_backward_host

    scale = D ** -0.5
    out = hccompile.lightning_attn(q, k, v, decay=decay)[0]

    def grad_step():
        torch.autograd.grad(hccompile.lightning_attn(q, k, v, decay=decay)[0], (q, k, v), do)

    def backward_only():  # the engine on a kept graph: the forward's cost left out
        torch.autograd.backward(out, do, retain_graph=True)

    return {
        "fwd+bwd (eager op)": step,
        "fwd+bwd by autograd.grad (no AccumulateGrad)": grad_step,
        "bwd by the engine (kept graph)": backward_only,
        "fwd (op, grad mode, graph dropped)": lambda: hccompile.lightning_attn(q, k, v, decay=decay),
        "bwd host fn in the main thread": lambda: _lightning_attn_backward_host(q, k, v, decay, None, do, None, scale),
        "fwd (op, no_grad)": forward_op,
        "fwd kernels (lightning_attn_fwd)": lambda: lightning_attn_fwd(q, k, v, d, None),
        "bwd kernels (lightning_attn_bwd)": lambda: lightning_attn_bwd(q, k, v, d, do, None),
    }


def gdn_parts(shape):
    import hccompile

    B, T, H, D = shape
    q, k, v = (torch.randn(B, T, H, D, device=DEVICE).bfloat16().requires_grad_() for _ in range(3))
    beta = torch.rand(B, T, H, device=DEVICE).bfloat16().requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=DEVICE)).requires_grad_()
    do = torch.randn(B, T, H, D, device=DEVICE).bfloat16()

    def call():
        return hccompile.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    def forward_op():
        with torch.no_grad():
            call()

    return {"fwd+bwd (eager op)": lambda: torch.autograd.backward(call(), do), "fwd (op, no_grad)": forward_op}


def engine_floor() -> None:
    """What the autograd engine alone costs a step whose backward is a Python function: a one-element
    tensor through an autograd.Function (forward x*2, backward g*2), against the same math as
    C++ autograd nodes, each with the backward on the engine's device thread and on the calling
    thread. If the Python node costs ~0.5 ms more on the device thread, so does any op's Python
    backward on this machine, ours and FLA's."""
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.ones(16, device=DEVICE, requires_grad=True)
    g = torch.ones(16, device=DEVICE)
    for label, fn in (("python Function", lambda: torch.autograd.backward(Double.apply(x), g)),
                      ("C++ nodes", lambda: torch.autograd.backward(x * 2, g))):
        threaded = host_ms(fn, 200)
        with torch.autograd.set_multithreading_enabled(False):
            caller = host_ms(fn, 200)
        print(f"engine floor, {label:15s}: fwd+bwd host {threaded:6.3f} ms on the device thread, "
              f"{caller:6.3f} ms on the calling thread", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="lightning,gdn")
    p.add_argument("--shape", default="B4T4096H16D128")
    p.add_argument("--stub", action="store_true",
                   help="CPU tensors, launches stubbed out (needs TRITON_INTERPRET=1): the host work left")
    args = p.parse_args()

    global DEVICE
    if args.stub:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--stub needs TRITON_INTERPRET=1 (set before Python starts)")
        from hccompile.kernels._triton import interpreter_problem

        problem = interpreter_problem()  # asked before the stub, which would fail its probe
        if problem is not None:
            p.error(f"the interpreter cannot run the kernels here: {problem}")
        DEVICE = "cpu"
    from hccompile.kernels import launcher

    shape = bthd(args.shape)
    clock = LaunchClock(stub=args.stub)
    widest = 0
    for op in args.ops.split(","):
        parts = {"lightning": lightning_parts, "lightning-nodecay": lambda s: lightning_parts(s, False),
                 "gdn": gdn_parts}[op](shape)
        for name, fn in parts.items():
            clock.reset()
            fast = host_ms(fn)
            missed = clock.count / 53  # host_ms: 3 warm-up calls and 50 timed
            launcher.enabled = False  # JITFunction.run for every launch, which the clock counts
            plain = host_ms(fn)
            clock.reset()
            steps = 50
            for _ in range(steps):
                fn()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            launcher.enabled = True
            widest = max(widest, clock.widest)
            launches = clock.count / steps
            inside = clock.seconds / steps * 1e3
            print(f"{op:9s} {name:34s} host {fast:6.3f} ms ({missed:4.1f} JITFunction.run a step through the "
                  f"Launcher; plain Triton launches {plain:6.3f} ms); "
                  f"{launches:4.1f} launches/step, "
                  f"{inside:6.3f} ms inside JITFunction.run ({inside / max(launches, 1) * 1e3:5.1f} us each)",
                  flush=True)
        print(f"          kernels launched: {clock.names}", flush=True)
        step = parts["fwd+bwd (eager op)"]
        with torch.autograd.set_multithreading_enabled(False):  # no device thread: the engine runs here
            print(f"{op:9s} fwd+bwd, the backward on the calling thread: host {host_ms(step):6.3f} ms", flush=True)
    if "lightning" in args.ops:  # a GIL handoff between the engine's device thread and ours would move with this
        step = lightning_parts(shape)["fwd+bwd (eager op)"]
        # 0.1 ms measured slower than the default 5 ms (session 38): a thread asks for the GIL while
        # the device thread runs our backward; if so, 50 ms is faster than the default
        for interval in (1e-4, 5e-2):
            sys.setswitchinterval(interval)
            print(f"lightning fwd+bwd, switch interval {interval * 1e3:g} ms: host {host_ms(step):6.3f} ms", flush=True)
        sys.setswitchinterval(5e-3)
        import threading

        print(f"Python threads alive: {[t.name for t in threading.enumerate()]}", flush=True)
    engine_floor()

    clock.close()
    if DEVICE != "cuda":
        return
    bare = bare_launch_fn(max(widest, 8))
    print(f"bare launch, {max(widest, 8)} args: {host_ms(bare, 500) * 1e3:6.1f} us", flush=True)
    through = bare_launch_fn(max(widest, 8), launcher.launcher)
    print(f"bare launch through hccompile's Launcher, {max(widest, 8)} args: {host_ms(through, 500) * 1e3:6.1f} us",
          flush=True)
    bare8 = bare_launch_fn(8)
    print(f"bare launch, 8 args: {host_ms(bare8, 500) * 1e3:6.1f} us", flush=True)
    for count in (max(widest, 8), 8):
        direct = compiled_launch_fn(count)
        if direct is not None:
            print(f"compiled launcher alone, {count} args: {host_ms(direct, 500) * 1e3:6.1f} us", flush=True)
    x = torch.empty(1, device=DEVICE)
    print(f"torch.empty [4,4096,16,128] bf16: "
          f"{host_ms(lambda: torch.empty(4, 4096, 16, 128, dtype=torch.bfloat16, device='cuda'), 500) * 1e3:6.1f} us",
          flush=True)
    print(f"x.float().contiguous() on a fp32 tensor: {host_ms(lambda: x.float().contiguous(), 500) * 1e3:6.1f} us")


if __name__ == "__main__":
    main()
