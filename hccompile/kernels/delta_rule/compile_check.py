"""Compile the delta-rule kernels (chunk.py's steps and cp.py's summaries) for a GPU target without a GPU and
read their registers, stack (spills) and shared memory, as hccompile.kernels.mhc.compile_check does
for the mHC kernels (whose compile and cuobjdump helpers this reuses).

Each launcher runs on small CPU tensors with its launches recorded (launch_recorder); the recorded
launches are compiled with the signature Triton's JIT would give them. The shapes keep the
benchmark's per-token layout (HV = 16 heads, so strides and divisibility hints match B4 T4096 H16);
only the token count is small, which does not change the specialisation (T = 128, two chunks, so
that no count argument is the constant 1). Run it in a process without TRITON_INTERPRET:

    python -m hccompile.kernels.delta_rule.compile_check               # K = 64, 128, 256; bf16, fp32
    python -m hccompile.kernels.delta_rule.compile_check --key-dims 128 --dtypes bfloat16

It prints one line per distinct compiled variant and exits non-zero when any spills or needs more
shared memory than an H100 gives a block (227 KiB).
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..launch_recorder import recording_launches
from ..mhc.compile_check import ARCH, compile_launch, private_triton_cache, resources

SHARED_LIMIT = 227 * 1024  # bytes of shared memory per block on sm_90


def _case(gate: str, key_dim: int, dtype: torch.dtype, varlen: bool, time: int = 128, heads: int = 16):
    """Inputs of one launch configuration: [1, T, H, K] varlen (two sequences) or [2, T, H, K]."""
    batch = 1 if varlen else 2
    value_dim = key_dim
    q, k = (torch.randn(batch, time, heads, key_dim, dtype=dtype) for _ in range(2))
    v = torch.randn(batch, time, heads, value_dim, dtype=dtype)
    beta = torch.rand(batch, time, heads, dtype=dtype)
    g = None
    if gate == "scalar":
        g = -torch.rand(batch, time, heads, dtype=dtype)
    elif gate == "channel":
        g = -torch.rand(batch, time, heads, key_dim, dtype=dtype)
    cu_seqlens = torch.tensor([0, 50, time], dtype=torch.int32) if varlen else None
    num_states = 2
    initial_state = torch.randn(num_states, heads, key_dim, value_dim)
    do = torch.randn(batch, time, heads, value_dim, dtype=dtype)
    dht = torch.randn(num_states, heads, key_dim, value_dim)
    return dict(q=q, k=k, v=v, beta=beta, g=g, gate=gate, initial_state=initial_state, cu_seqlens=cu_seqlens,
                use_qk_l2norm_in_kernel=True), do, dht


def recorded_launches(gate: str, key_dim: int, dtype: torch.dtype, varlen: bool):
    """[(name, kernel, args, kwargs)] of every kernel launch of the forward, the backward and (varlen) the CP
    summary kernels for one configuration."""
    from . import chunk, cp
    from .plan import DEFAULT_CHUNK_SIZE

    inputs, do, dht = _case(gate, key_dim, dtype, varlen)
    batch, time, heads = do.shape[:3]
    kept = tuple(torch.zeros(batch, time, heads, DEFAULT_CHUNK_SIZE) for _ in range(3))
    runs = [
        ("fwd", lambda: chunk.chunk_delta_rule_fwd(**inputs, output_final_state=True)),
        ("bwd", lambda: chunk.chunk_delta_rule_bwd(**inputs, do=do, dht=dht)),
        # The backward that reuses the forward's kept matrices: wy_solve without its solve.
        ("bwd_kept", lambda: chunk.chunk_delta_rule_bwd(**inputs, do=do, dht=dht, intermediates=kept)),
    ]
    if varlen:
        cp_inputs = {n: t for n, t in inputs.items() if n != "initial_state"}
        runs += [
            ("cp_summary_fwd", lambda: cp.summary_forward(**cp_inputs)),
            ("cp_summary_bwd", lambda: cp.summary_backward(**cp_inputs, do=do)),
        ]
    out = []
    for name, run in runs:
        with recording_launches() as calls:
            run()
        for kernel, _grid, args, kwargs in calls:
            out.append((name, kernel, args, kwargs))
    return out


def _signature_key(kernel, args, kwargs):
    """What the compile depends on: the kernel, its constexprs and launch options, the dtypes of its
    tensors and which integers are 1 or 16-divisible (data values do not matter)."""
    # constexprs and launch options by value; a tensor passed by keyword by its dtype
    parts = [kernel.__name__, repr(sorted((name, str(value.dtype) if isinstance(value, torch.Tensor) else value)
                                          for name, value in kwargs.items()))]
    constexpr = {p.name for p in kernel.params if p.is_constexpr}
    for name, value in zip(kernel.arg_names, args):
        if name in constexpr:
            parts.append((name, repr(value)))
        elif isinstance(value, torch.Tensor):
            parts.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool):
            parts.append((name, "1" if value == 1 else ("d16" if value % 16 == 0 else "i")))
        else:
            parts.append((name, repr(value)))
    return tuple(parts)


def main(argv=None) -> int:
    import os

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--key-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--gates", nargs="+", default=["none", "scalar", "channel"])
    parser.add_argument("--varlen", nargs="+", default=["off", "on"])
    parser.add_argument("--kernels", nargs="*", default=None, help="only kernels whose name contains one of these")
    options = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile kernels", file=sys.stderr)
        return 2
    with private_triton_cache():
        return _report(options)


def _report(options) -> int:
    seen, failures = set(), 0
    for dtype_name in options.dtypes:
        dtype = getattr(torch, dtype_name)
        for key_dim in options.key_dims:
            for gate in options.gates:
                for varlen in options.varlen:
                    for name, kernel, args, kwargs in recorded_launches(gate, key_dim, dtype, varlen == "on"):
                        kname = kernel.__name__.strip("_").removesuffix("_kernel")
                        if options.kernels and not any(part in kname for part in options.kernels):
                            continue
                        key = _signature_key(kernel, args, kwargs)
                        if key in seen:
                            continue
                        seen.add(key)
                        compiled = compile_launch(kernel, args, kwargs, ARCH)
                        usage = resources(compiled)
                        # cuobjdump's SHARED is the static part only; Triton allocates dynamically.
                        stack, shared = usage.get("STACK", 0), compiled.metadata.shared
                        bad = stack > 0 or shared > SHARED_LIMIT
                        failures += bad
                        tiles = {k: v for k, v in kwargs.items()
                                 if k in ("BT", "BC", "BK", "BKF", "BV", "num_warps", "num_stages")}
                        print(f"{kname:24s} {dtype_name:8s} K{key_dim:<3d} {gate:7s} varlen={varlen:3s} "
                              f"{tiles} REG {usage['REG']} STACK {stack} SHARED {shared}"
                              f"{'  <-- FAIL' if bad else ''}", flush=True)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
