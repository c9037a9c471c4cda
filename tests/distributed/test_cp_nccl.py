"""Context parallelism over two GPUs with NCCL: examples/cp_torchrun.py under torchrun checks the CP
output, final states and dq against one process on all tokens (it asserts a relative error < 1e-4)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
# NVLink multicast (NVLS) off: the lent multi-GPU machines do not support it (the device's KINDS.md).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_torchrun_example_on_two_gpus():
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(ROOT / "examples" / "cp_torchrun.py")], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, **NO_MULTICAST})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "relative error vs one process" in result.stdout
