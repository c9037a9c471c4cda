import os

import pytest
import torch

import hccompile  # noqa: F401  (registers ops)
import interpreter_compat


def _check_expected_triton() -> None:
    """`make test-triton-oldest` puts Triton 3.6 ahead of .venv's on PYTHONPATH and names the version
    in HCCOMPILE_EXPECT_TRITON: a process that imported another Triton would test the wrong one."""
    import triton

    expected = os.environ.get("HCCOMPILE_EXPECT_TRITON")
    if expected and triton.__version__ != expected:
        raise pytest.UsageError(f"HCCOMPILE_EXPECT_TRITON={expected}, but this process imported Triton "
                                f"{triton.__version__} from {triton.__file__}")


_check_expected_triton()


def _check_no_fla() -> None:
    """The HF client tests and the docs' HF example compile transformers' plain-PyTorch layers; with
    flash-linear-attention importable, transformers runs FLA's kernels in those layers instead, and
    six tests failed for that reason in the suite at f082924 (the benchmarks' FLA wheels had been
    installed into the suite's package directory on the same machine)."""
    import importlib.util

    spec = importlib.util.find_spec("fla")
    if spec is not None:
        raise pytest.UsageError(f"flash-linear-attention is importable ({spec.origin}): transformers would "
                                "run its kernels in the layers the tests compile as plain PyTorch; run the "
                                "suite without it on the path (make bench-gpu installs it apart)")


_check_no_fla()
interpreter_compat.apply()  # before any kernel runs: the package's interpreter probe is cached


def _bound_gpu_memory() -> None:
    """Cap this process's CUDA allocator (tests/parallel.py --gpu-memory-gib): workers share one GPU,
    and a test that needs more than its share fails with an out-of-memory error naming the bound
    instead of starving its neighbours."""
    gib = os.environ.get("HCCOMPILE_TEST_GPU_MEMORY_GIB")
    if gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(gib) * 2**30 / total))


_bound_gpu_memory()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
