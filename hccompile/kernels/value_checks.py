"""Whether the ops read an input's values to check them (the delta rule's log-gates, lightning's
log-decays): always for CPU tensors; on a GPU reading values synchronises the host with the device,
so only with HCCOMPILE_CHECK_GATES=1 (read at every call). One switch for every value check."""
from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch

ENV = "HCCOMPILE_CHECK_GATES"
_TRUE = ("1", "true", "yes", "on")


def checks_on_gpu() -> bool:
    """HCCOMPILE_CHECK_GATES is set: values on every device are checked."""
    return os.environ.get(ENV, "0").lower() in _TRUE


def values_checked(device: torch.device) -> bool:
    """Whether values on `device` are read and checked."""
    return device.type == "cpu" or checks_on_gpu()


# (id of a tensor, what was computed) -> (weakref to the tensor, its version, the value)
_BY_TENSOR: OrderedDict[tuple, tuple[weakref.ref, int, Any]] = OrderedDict()
_BY_TENSOR_ENTRIES = 16


def cached_by_tensor(tensor: torch.Tensor, what: tuple, compute: Callable[[], Any]) -> Any:
    """compute(), a function of `tensor`'s values (and of `what`, which names it and its other
    inputs), computed once while the same tensor object lives unmodified (its version counter). Why:
    cu_seqlens is read on the host by the checks and launch plans of every op call — forward and
    backward, every layer of a model — and on a GPU each read synchronises the host with the device.
    A tensor whose version cannot be read (an inference tensor) is not cached."""
    try:
        version = tensor._version
    except RuntimeError:
        return compute()
    key = (id(tensor), what)
    hit = _BY_TENSOR.get(key)
    if hit is not None and hit[0]() is tensor and hit[1] == version:
        _BY_TENSOR.move_to_end(key)
        return hit[2]
    value = compute()
    _BY_TENSOR[key] = (weakref.ref(tensor), version, value)
    while len(_BY_TENSOR) > _BY_TENSOR_ENTRIES:
        _BY_TENSOR.popitem(last=False)
    return value


def host_ints(tensor: torch.Tensor) -> tuple[int, ...]:
    """The values of an integer tensor (cu_seqlens) as Python ints, read once per tensor and version
    (cached_by_tensor): one synchronisation for all the ops of a step, not one per check."""
    return cached_by_tensor(tensor, ("host_ints",), lambda: tuple(int(x) for x in tensor.tolist()))
