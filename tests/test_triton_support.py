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


def _guards_of_a_cloned_buffer(rows_of):
    """The guards that cloning (as functionalizing a traced launch does) a [rows_of(count), 2, 8]
    buffer adds, for counts from a symbolic length T traced at 96: ceil(T / 64) (delta-rule
    chunks) and the lightning plan's segments per row at a segment of 64 * min(ceil(T / 64), 4)."""
    import torch
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    added = []
    for count_of in (lambda t: (t + 63) // 64,
                     lambda t: torch.sym_max((t + 64 * torch.sym_min((t + 63) // 64, 4) - 1)
                                             // (64 * torch.sym_min((t + 63) // 64, 4)), 1)):
        env = ShapeEnv()
        time = env.create_symintnode(env.create_symbol(96, ConstantSource("T")), hint=96)
        count = count_of(time)
        with FakeTensorMode(shape_env=env):
            buffer = torch.empty((rows_of(count), 2, 8))
            buffer.clone()
        added += [str(g.expr) for g in env.guards]
        rows, symbol = buffer.shape[0].node.expr, time.node.expr
        assert all(rows.subs(symbol, t) >= count.node.expr.subs(symbol, t) for t in range(2, 600, 7))
    return added


def test_scratch_rows_of_a_symbolic_count_add_no_guard():
    """A buffer with one row per chunk or segment, its count symbolic: cloning it must not guard on
    whether the count is 1 (a second graph for T <= 64, or past a segment boundary)."""
    assert _guards_of_a_cloned_buffer(_triton.scratch_rows) == []
    assert _triton.scratch_rows(0) == 1 and _triton.scratch_rows(1) == 1 and _triton.scratch_rows(5) == 5
    # the hazard itself, on this torch: the plain count guards (if torch stops doing so, scratch_rows
    # could go; this line says when)
    assert _guards_of_a_cloned_buffer(lambda count: count), "torch no longer guards here: scratch_rows may go"


def test_host_cdiv_and_next_power_of_2_equal_tritons():
    """The launchers' host helpers (kernels/_triton.py) give triton.cdiv's and triton.next_power_of_2's
    values, symbolic sizes included for cdiv, without their constexpr-function wrappers."""
    import triton
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from hccompile.kernels._triton import cdiv, next_power_of_2

    for n in [*range(0, 300), 2**20, 2**20 + 1, 3 * 2**31]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    env = ShapeEnv()
    t = env.create_unbacked_symint()
    assert str(cdiv(t, 64)) == str(triton.cdiv(t, 64))
