"""Every difference between the torch versions we support (2.11 and 2.13) lives here."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
MIN_TORCH = (2, 11)


def check_torch_version() -> None:
    if TORCH_VERSION < MIN_TORCH:
        raise RuntimeError(
            f"hccompile needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found {torch.__version__}"
        )


def custom_pass_hook_value(pass_obj: Any) -> Any:
    """Value for `joint_custom_pre_pass` / `post_grad_custom_pre_pass`.

    2.11 takes exactly one CustomGraphPass per hook; 2.13 also accepts a list. We always install
    one composite pass, so a single object works on both.
    """
    return pass_obj


def size_hint(value: Any) -> int:
    """Concrete value of a possibly symbolic int, without adding a guard."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        node = value.node
        hint = getattr(node, "hint", None)
        if hint is not None:
            return int(hint)
        return int(node.shape_env.size_hint(node.expr))
    return int(value)


def concrete_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(size_hint(s) for s in t.shape)


def fake_mode_of(example_inputs: Any, gm: torch.fx.GraphModule | None = None):
    """The fake mode of the Dynamo graph's example values (the tracing context's), which is not
    always the one the example inputs would suggest."""
    from torch._guards import detect_fake_mode

    if gm is not None:
        for n in gm.graph.nodes:
            val = n.meta.get("example_value")
            if isinstance(val, torch.Tensor):
                mode = detect_fake_mode([val])
                if mode is not None:
                    return mode
    return detect_fake_mode(example_inputs)


def hash_files(paths: tuple[str, ...], extra: str = "") -> bytes:
    from torch._inductor.custom_graph_pass import get_hash_for_files

    return get_hash_for_files(paths, extra)


# --- recording autograd inside a custom op's implementation (private dispatcher API) ---
# The Autograd dispatch keys that a custom op's implementation runs without (it is called below
# Autograd, under the equivalent of torch._C._AutoDispatchBelowAutograd).
_AUTOGRAD_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor))


@contextlib.contextmanager
def autograd_recording():
    """Lets torch.autograd.grad work inside the backward op's implementation: custom ops run below
    the Autograd dispatch key, where no graph is recorded even under enable_grad. Both backward
    paths need it: the fallback differentiates the reference, and the kernels differentiate KDA's
    gate activation by autograd. (torch.func.vjp would avoid the private guard but breaks under
    the dispatch modes of opcheck.) Only the Autograd keys are restored; autocast stays as it was."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    included = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(included, excluded - _AUTOGRAD_KEYS), torch.enable_grad():
        yield



# --- collectives ---
def all_gather_single(output, input, group=None, async_op: bool = False):
    """Every rank's `input` concatenated into `output`: torch 2.13 deprecates
    all_gather_into_tensor for all_gather_single (same arguments); 2.11 has only the former."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def has_inductor_option(name: str) -> bool:
    """Whether this torch's Inductor config has `name` (options come and go between versions)."""
    from torch._inductor import config as inductor_config

    return hasattr(inductor_config, name)
