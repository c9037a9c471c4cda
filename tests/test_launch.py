"""lowering/_launch.py: the triton_op + host-op pair every kernel op is made of (issue 24)."""
from __future__ import annotations

import pytest
import torch

import hccompile  # noqa: F401  (registers the ops)
from hccompile.lowering import _launch


@pytest.mark.parametrize("name", ["mhc_post", "mhc_post_backward", "mhc_aggregate",
                                  "mhc_aggregate_backward", "mhc_mapping", "mhc_mapping_backward",
                                  "htree_attention", "htree_attention_backward"])
def test_op_and_its_host_twin_share_one_schema(name):
    op = getattr(torch.ops.hccompile, name).default
    host = getattr(torch.ops.hccompile, f"{name}_host").default
    assert str(op._schema).replace(f"::{name}(", "(") == str(host._schema).replace(f"::{name}_host(", "(")


def test_each_op_is_named_by_its_own_first_kernel():
    """A graph traced on CUDA holds kernel launches; op_inventory names the op by its first
    kernel, so a kernel may be the first of one op only."""
    firsts = [n for _, n, _ in _launch._KERNEL_OPS.values() if n]
    assert len(firsts) == len(set(firsts))
    if not firsts:
        pytest.skip("Triton is not installed: no kernels")
    kernel = next(k for k, n, _ in _launch._KERNEL_OPS.values() if n == "hccompile.mhc_post.default")
    with pytest.raises(ValueError, match="already the first kernel of hccompile.mhc_post.default"):
        _launch.launched_by("hccompile.other.default", kernel)
    _launch.launched_by("hccompile.other.default", None, kernel)  # a later kernel: allowed
    assert _launch.launched_op(kernel) == ("hccompile.mhc_post.default", 1)
    assert _launch.launched_op(None) == ("", 1)


def test_cpu_tensors_run_the_host_op():
    assert not _launch.traced_launch(torch.ones(1), (torch.float32,))
    assert not _launch.traced_launch(torch.ones(1, dtype=torch.float64), (torch.float32,))
