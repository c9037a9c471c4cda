"""Where the Triton kernels run: hccompile.kernels._triton's interpreter probe and its fallback."""
import pytest

from hccompile.kernels import _triton


def test_an_interpreter_that_cannot_run_the_kernels_means_the_references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read at call time; the probe itself is replaced below
    class BrokenLoopBounds:  # what Triton 3.6's interpreter does with NumPy >= 2.4
        def __getitem__(self, grid):
            def launch(*args):
                raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
            return launch

    _triton.interpreter_problem.cache_clear()
    try:
        if _triton.interpreted(_triton._runtime_loop_probe):  # kernels defined for the interpreter
            assert _triton.triton_available("cpu")  # this test environment's interpreter works
        _triton.interpreter_problem.cache_clear()
        monkeypatch.setattr(_triton, "_runtime_loop_probe", BrokenLoopBounds())
        monkeypatch.setattr(_triton, "interpreted", lambda kernel: True)
        with pytest.warns(UserWarning, match=r"interpreter cannot run the kernels .*numpy<2.4"):
            assert not _triton.triton_available("cpu")
        assert "only 0-dimensional arrays" in _triton.interpreter_problem()
        assert _triton.triton_available("cuda")  # the GPU is not the interpreter's business
    finally:
        _triton.interpreter_problem.cache_clear()
