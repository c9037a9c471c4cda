"""hc_project: a fused mHC mapping's projection linear(v, φ) and the reduction of v² its norm is made
from become one hccompile::mhc_project. Every spelling of the squares and the reduction it claims
(x·x, x**2, x.pow(2), x.square(); mean or sum, keepdim or not; squares in float32 or not), the
near-misses it must refuse (a bias, squares of another tensor), the replaced graph against the
unreplaced one (outputs and gradients), several lengths in one compiled graph, and the recompute
plan keeping the op's per-token outputs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import hccompile.passes.hc_project  # noqa: F401  (registers the pass)
from hccompile.nn.mhc import MHCGPT
from helpers import Collect
from test_hc_fuse import (assert_close, dynamo_graph, matches, one_graph_for_every_length, outputs_and_grads, refusals,
                          run_dynamo_passes)

PASSES = ("hc_detect", "hc_fuse", "hc_project", "recompute")


def project_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "mhc_project" in str(n.target)]


class SpelledHC(nn.Module):
    """One mHC layer whose norm statistic is spelled as asked: `square` in pow / mul / square /
    operator, `reduce` in mean / sum (then divided by K) with or without keepdim, squares in
    float32 (`cast`) or in the stream's dtype; near-misses: a bias on φ, squares of another tensor
    than the projection's input, the reduction over another dim."""

    def __init__(self, n=3, C=20, square="pow", reduce="mean-keepdim", cast=False, bias=False,
                 other_tensor=False, flat_input=False):
        super().__init__()
        self.n, self.C, self.flat_input = n, C, flat_input
        self.square, self.reduce, self.cast, self.other_tensor = square, reduce, cast, other_tensor
        self.phi = nn.Linear(n * C, n * n + 2 * n, bias=bias)
        self.alpha = nn.Parameter(torch.tensor([0.8, -1.1, 1.3]))
        self.bias_pre = nn.Parameter(torch.randn(n))
        self.bias_res = nn.Parameter(torch.randn(n, n))
        self.f = nn.Linear(C, C)

    def statistic(self, v):
        u = (v * 1.0) if self.other_tensor else v
        u = u.float() if self.cast else u
        sq = {"pow": lambda: u.pow(2), "mul": lambda: u * u, "square": lambda: u.square(),
              "operator": lambda: u ** 2}[self.square]()
        K = v.shape[-1]
        if self.reduce == "mean-keepdim":
            return sq.mean(-1, keepdim=True)
        if self.reduce == "mean":
            return sq.mean(dim=-1).unsqueeze(-1)
        if self.reduce == "sum-keepdim":
            return sq.sum(-1, keepdim=True) / K
        raise ValueError(self.reduce)

    def forward(self, x):  # [B, S, n, C], or [B, S, n·C] if flat_input
        n = self.n
        if self.flat_input:  # v is a graph input, as φ is: the op goes after both placeholders
            v, x = x, x.unflatten(-1, (n, self.C))
        else:
            v = x.flatten(-2)
        rinv = torch.rsqrt(self.statistic(v) + 1e-6).to(x.dtype)
        pre, post, res = self.phi(v).split([n, n, n * n], dim=-1)
        h_pre = torch.sigmoid(pre * rinv * self.alpha[0] + self.bias_pre)
        h_post = 2 * torch.sigmoid(post * rinv * self.alpha[1])
        logits = res.unflatten(-1, (n, n)) * self.alpha[2] * rinv.unsqueeze(-1) + self.bias_res
        m = torch.exp(logits)
        for _ in range(2):
            m = m / (m.sum(-2, keepdim=True) + 1e-5)
            m = m / (m.sum(-1, keepdim=True) + 1e-5)
        y = (h_pre.unsqueeze(-1) * x).sum(-2)
        fy = self.f(y)
        return m @ x + h_post.unsqueeze(-1) * fy.unsqueeze(-2)


def _fused(m, x):
    gm, ex = dynamo_graph(m, x)
    want = outputs_and_grads(m, [x], [x] + list(m.parameters()))
    records, report = run_dynamo_passes(gm, ex, names=PASSES)
    return gm, ex, want, records, report


@pytest.mark.parametrize("square", ["pow", "mul", "square", "operator"])
@pytest.mark.parametrize("reduce,cast", [("mean-keepdim", False), ("mean", True), ("sum-keepdim", True)])
def test_every_spelling_becomes_one_op_and_computes_the_same(square, reduce, cast):
    torch.manual_seed(3)
    m = SpelledHC(square=square, reduce=reduce, cast=cast)
    x = torch.randn(2, 5, 3, 20, requires_grad=True)
    gm, ex, want, records, _ = _fused(m, x)
    assert len(matches(records, "mhc_mapping")) == 1, refusals(records)
    (match,) = matches(records, "mhc_project")
    assert match["reduction"] == ("sum" if reduce.startswith("sum") else "mean")
    assert match["probe_rel_err"] < 1e-5
    assert len(project_nodes(gm)) == 1
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.nn.functional.linear
                and n.args[1].name.endswith("phi_parameters_weight_")], "the projection's linear is left"
    got = outputs_and_grads(gm, ex, [x] + list(m.parameters()))
    assert_close([got[0]], [want[0]], 1e-5, "out")
    assert_close(got[1], want[1], 1e-4, "grad")


def test_a_stream_given_flat_is_projected_after_the_inputs():
    torch.manual_seed(3)
    m = SpelledHC(flat_input=True)
    x = torch.randn(2, 5, 60, requires_grad=True)
    gm, ex, want, records, _ = _fused(m, x)
    assert len(matches(records, "mhc_project")) == 1, refusals(records)
    kinds = [n.op for n in gm.graph.nodes]
    assert "placeholder" not in kinds[kinds.index("call_function"):], "a node among the inputs"
    got = outputs_and_grads(gm, ex, [x] + list(m.parameters()))
    assert_close([got[0]], [want[0]], 1e-5, "out")
    assert_close(got[1], want[1], 1e-4, "grad")


@pytest.mark.parametrize("near_miss,reason", [
    (dict(bias=True), "has a bias"),
    (dict(other_tensor=True), "not the projection's input"),
])
def test_near_misses_are_refused_with_the_reason(near_miss, reason):
    torch.manual_seed(4)
    m = SpelledHC(**near_miss)
    x = torch.randn(2, 5, 3, 20, requires_grad=True)
    gm, ex, want, records, _ = _fused(m, x)
    if not matches(records, "mhc_mapping"):
        pytest.skip(f"hc_fuse already refuses this mapping: {refusals(records, 'mhc_mapping')}")
    assert not matches(records, "mhc_project") and not project_nodes(gm)
    (refused,) = refusals(records, "mhc_project")
    assert reason in refused["reason"], refused
    got = outputs_and_grads(gm, ex, [x] + list(m.parameters()))
    assert_close([got[0]], [want[0]], 1e-5, "out")
    assert_close(got[1], want[1], 1e-4, "grad")


def test_a_wrong_replacement_is_refused_by_the_probe(monkeypatch):
    """The probe compares the region with the replacement: a replacement that computes another
    function (the mean taken as the sum) is refused, the graph left as it was."""
    from hccompile.passes import hc_project

    original = hc_project.build_project

    def wrong(plan, em, v, phi):
        plan.mean = False
        return original(plan, em, v, phi)

    monkeypatch.setattr(hc_project, "build_project", wrong)
    torch.manual_seed(5)
    m = SpelledHC()
    x = torch.randn(2, 5, 3, 20, requires_grad=True)
    gm, _, _, records, _ = _fused(m, x)
    (refused,) = refusals(records, "mhc_project")
    assert "probe mismatch" in refused["reason"] and not project_nodes(gm)


def test_block_recompute_keeps_the_ops_outputs():
    """The projection and Σ v² (the op's getitems) and the norm computed from them alone are kept
    per token, not rebuilt: a rebuilt projection would read the stream again in backward."""
    torch.manual_seed(0)
    m = MHCGPT(32, 2, 2, n=4, sinkhorn_iters=2)
    x = torch.randn(1, 8, 32)
    gm, ex = dynamo_graph(m, x)
    records, report = run_dynamo_passes(gm, ex, names=PASSES)
    assert len(matches(records, "mhc_project")) == 4 and not refusals(records, "mhc_project")
    for block in report.recompute_plan:
        kinds = sorted(name.rstrip("_0123456789") for name in block["kept_per_token"])
        assert kinds == ["add"] * 2 + ["getitem"] * 4 + ["sqrt"] * 2 + ["truediv"] * 2, block
        assert not block["rebuilt_per_token"], block


def test_disabled_leaves_the_linear_and_the_mean():
    torch.manual_seed(0)
    m = MHCGPT(32, 2, 1, n=4, sinkhorn_iters=2)
    x = torch.randn(2, 8, 32)
    be = Collect(compiler="aot_eager", disable_passes=("hc_project",))
    torch.compile(m, backend=be)(x)
    assert not [mm for mm in be.matches if mm["pattern"] == "mhc_project"]
    assert len([mm for mm in be.matches if mm["pattern"] == "mhc_mapping"]) == 2


def test_one_graph_for_every_length_with_dropout_and_recompute():
    """The whole backend (hc_fuse, hc_project, block recompute), dynamic lengths, dropout: one
    compile serves S 8, 13 and 21; outputs and gradients equal the eager model's."""
    torch.manual_seed(0)
    m = MHCGPT(32, 2, 2, n=4, sinkhorn_iters=3, dropout=0.0)
    be = one_graph_for_every_length(m, lambda S: torch.randn(2, S, 32), (8, 13, 21))
    assert len([mm for mm in be.matches if mm["pattern"] == "mhc_project"]) == 4


def test_the_backward_never_rebuilds_the_projection():
    """The partitioner decides at the op, not at its getitems: the op itself is kept, so the
    backward calls only mhc_project_backward, never the projection (which would read the rebuilt
    stream again and keep it alive: +0.11 GiB peak, no faster step on the H200 at 50a79bc)."""
    torch.manual_seed(0)
    m = MHCGPT(32, 2, 2, n=4, sinkhorn_iters=2)
    x = torch.randn(2, 8, 32)
    be = Collect()
    torch.compile(m, backend=be)(x).float().sum().backward()
    fwd = [op for op in be.ops("forward") if "mhc_project" in op]
    bwd = [op for op in be.ops("backward") if "mhc_project" in op]
    assert fwd == ["hccompile.mhc_project.default"] * 4, be.ops("forward")
    assert bwd == ["hccompile.mhc_project_backward.default"] * 4, be.ops("backward")
