"""Whether the ops read an input's values to check them (the delta rule's log-gates, lightning's
log-decays): always for CPU tensors; on a GPU reading values synchronises the host with the device,
so only with HCCOMPILE_CHECK_GATES=1 (read at every call). One switch for every value check."""
from __future__ import annotations

import os

import torch

ENV = "HCCOMPILE_CHECK_GATES"
_TRUE = ("1", "true", "yes", "on")


def checks_on_gpu() -> bool:
    """HCCOMPILE_CHECK_GATES is set: values on every device are checked."""
    return os.environ.get(ENV, "0").lower() in _TRUE


def values_checked(device: torch.device) -> bool:
    """Whether values on `device` are read and checked."""
    return device.type == "cpu" or checks_on_gpu()
