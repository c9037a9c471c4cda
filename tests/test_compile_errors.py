"""Argument errors raised while torch.compile traces an op name values, not bare symbols
(hccompile/lowering/_symbols.py): under dynamic shapes a size is a symbol such as s81, and the
ops' checks would otherwise print "(1, s81, s0) differ from q's (1, s34, s0)"."""
from __future__ import annotations

import os
import re

import pytest
import torch

from hccompile.lowering._symbols import explain_symbols
from hccompile.lowering.delta_rule import chunk_gated_delta_rule
from hccompile.lowering.htree import htree_attention
from hccompile.lowering.lightning import lightning_attn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_CAN_RUN = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
requires_kernels = pytest.mark.skipif(not KERNELS_CAN_RUN, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def _compile_error(fn, *args) -> str:
    torch._dynamo.reset()
    with pytest.raises(Exception) as caught:
        torch.compile(fn, backend="hc", fullgraph=True, dynamic=True)(*args)
    torch._dynamo.reset()
    return str(caught.value)


def _randn(*shape):
    return torch.randn(*shape, device=DEVICE)


@requires_kernels
def test_lightning_shape_error_under_compile_names_values_and_symbols():
    q, k, v = _randn(1, 32, 2, 16), _randn(1, 32, 2, 16), _randn(1, 33, 2, 16)
    with pytest.raises(ValueError) as eager:
        lightning_attn(q, k, v)
    assert "differ from q's (1, 32, 2)" in str(eager.value) and "symbols" not in str(eager.value)

    message = _compile_error(lambda q, k, v: lightning_attn(q, k, v)[0], q, k, v)
    assert "v: batch, time, heads (1, 33, 2) differ from q's (1, 32, 2)" in message, message
    assert re.search(r"v\.shape\[1\] is s\d+ = 33 in this call", message), message
    assert re.search(r"q\.shape\[1\] is s\d+ = 32 in this call", message), message


@requires_kernels
def test_delta_rule_shape_error_under_compile_names_values_and_symbols():
    q, k = _randn(1, 40, 2, 16), _randn(1, 40, 2, 16)
    v, g, beta = _randn(1, 41, 2, 16), -torch.rand(1, 40, 2, device=DEVICE), torch.rand(1, 40, 2, device=DEVICE)
    message = _compile_error(lambda *a: chunk_gated_delta_rule(*a)[0], q, k, v, g, beta)
    assert "v: batch, time (1, 41) differ from q's (1, 40)" in message, message
    assert re.search(r"v\.shape\[1\] is s\d+ = 41 in this call", message), message


@requires_kernels
def test_htree_shape_error_under_compile_names_values_and_symbols():
    q, k, v = _randn(1, 48, 4, 16), _randn(1, 49, 2, 16), _randn(1, 49, 2, 16)
    message = _compile_error(lambda *a: htree_attention(*a, compression_rate=4, top_k=2), q, k, v)
    assert "differ from q's (1, 48)" in message, message
    assert re.search(r"\.shape\[1\] is s\d+ = 49 in this call", message), message


def test_explain_symbols_leaves_other_messages_alone():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    time = env.create_symintnode(env.create_symbol(33, ConstantSource("T")), hint=33)
    symbol = str(time.node.expr)
    assert explain_symbols("k: head dim 100 exceeds 64", {"time": time}) is None
    assert explain_symbols(f"a size {symbol}9 that is not an argument's", {"time": time}) is None
    text = explain_symbols(f"time {symbol} is odd", {"time": time})
    assert text == f"time 33 is odd (under torch.compile sizes are symbols: time is {symbol} = 33 in this call)"
    assert explain_symbols(f"{text}, {symbol}", {"time": time}) is None  # explained once (op body, host twin)
    assert env.guards == []  # reading a symbol's value adds no guard
