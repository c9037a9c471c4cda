"""mHC as other people write it (issue 18, item 3), not only as hccompile.nn does:

- the public `hyper-connections` package (PyPI, 0.4.11) as a client, used as its README shows: its
  manifold-constrained variant folds the streams into the batch ((b·n), t, d), normalises each
  stream before its projections, applies H_pre and H_res in one einsum and contracts with a sum;
- the DeepSeek-V4 style form, written here in plain PyTorch: the stream kept as [B, S, n, C], the
  mappings from one `F.linear` of the flattened stream times its inverse RMS, and einsums for the
  aggregate, the mixing (H_res or H_resᵀ) and the post-distribution;
- near-misses that must not be taken for mHC: a mixing matrix that is not Sinkhorn-normalised, the
  tanh mappings of the original Hyper-Connections (also the package's own default class).

For each form found: detection, fusion where the math matches (the package's mapping is refused with
the reasons), block recompute, equality with eager (fp32), saved-for-backward bytes against
Inductor's, and gradients with dropout bit-identical to hc_recompute="off" on CPU.
"""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hccompile.passes.hc_fuse  # noqa: F401  (registers the pass)
from helpers import Collect, train_step
from test_hc_fuse import (OPS, assert_close, dynamo_graph, matches, op_nodes, outputs_and_grads,
                          refusals, run_dynamo_passes)

try:
    import hyper_connections
except ImportError:  # the test extra installs it; see pyproject.toml
    hyper_connections = None

PACKAGE = pytest.mark.skipif(
    hyper_connections is None,
    reason="needs the hyper-connections package: pip install hyper-connections==0.4.11 "
           "(or pip install -e '.[test]')")

# The issue's target for every detected form: saved-for-backward bytes with block recompute at most
# 0.6x Inductor's.
SAVED_RATIO_TARGET = 0.6


# ----------------------------------------------------------------------------------------------
# the sublayers, as a user writes them


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0, norm: bool = True):
        super().__init__()
        self.heads = heads
        self.norm = nn.RMSNorm(dim) if norm else nn.Identity()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):  # [B, S, C]
        B, S, C = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.out(o.transpose(1, 2).reshape(B, S, C)))


class FeedForward(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0, norm: bool = True):
        super().__init__()
        self.net = nn.Sequential(nn.RMSNorm(dim) if norm else nn.Identity(), nn.Linear(dim, 4 * dim),
                                 nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x):
        return self.net(x)


# ----------------------------------------------------------------------------------------------
# the hyper-connections package, as its README uses it


class PackageTransformer(nn.Module):
    """A small transformer on the package's mHC: `mc_get_init_and_expand_reduce_stream_functions`
    (the manifold-constrained variant; the README's unprefixed function gives the original,
    tanh-based Hyper-Connections), each branch wrapped with `init_hyper_conn(dim=, branch=)`,
    expand before the trunk, reduce (a sum over the streams) after it."""

    def __init__(self, dim=32, depth=2, heads=2, streams=4, dropout=0.0, sinkhorn_iters=4,
                 manifold=True, **hc_kwargs):
        super().__init__()
        fns = (hyper_connections.mc_get_init_and_expand_reduce_stream_functions if manifold else
               hyper_connections.get_init_and_expand_reduce_stream_functions)
        kwargs = {"sinkhorn_iters": sinkhorn_iters} if manifold else {}
        init_hc, self.expand_streams, self.reduce_streams = fns(streams, **kwargs, **hc_kwargs)
        self.layers = nn.ModuleList()
        for i in range(depth):
            self.layers.append(nn.ModuleList([
                init_hc(dim=dim, branch=Attention(dim, heads, dropout), layer_index=2 * i),
                init_hc(dim=dim, branch=FeedForward(dim, dropout), layer_index=2 * i + 1)]))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        x = self.expand_streams(x)
        for attn, ff in self.layers:
            x = attn(x)
            x = ff(x)
        return self.head(self.norm(self.reduce_streams(x)))


def _package_model(dropout=0.0, **kwargs):
    """The package initialises the dynamic parts at zero (every token gets the static mapping);
    randomise them so that each mapping part matters."""
    torch.manual_seed(0)
    m = PackageTransformer(dropout=dropout, **kwargs)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("dynamic_alpha_fn", "dynamic_beta_fn")):
                p.normal_(0.0, 0.3)
            elif name.endswith(("pre_branch_scale", "residual_scale", "h_post_scale")):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("static_alpha", "static_beta", "gamma")):
                p.add_(0.3 * torch.randn_like(p))
        # einops registers its torch backend on first use, and Dynamo guards on that registry:
        # without this eager call the second compiled call recompiles (once, as for any user)
        m(torch.randn(1, 2, m.norm.normalized_shape[0]))
    return m


@PACKAGE
def test_package_mhc_detected_every_layer_chained():
    m = _package_model()
    be = Collect(compiler="aot_eager", disable_passes=("hc_fuse",))
    torch.compile(m, backend=be)(torch.randn(2, 8, 32))
    layers = [x for x in be.matches if x["pattern"] == "mhc_layer"]
    assert [x["layer"] for x in layers] == [0, 1, 2, 3]
    assert all(x["sinkhorn_rounds"] == 4 and x["combined"] for x in layers)
    assert all("per stream" in x["stream_norm"] for x in layers)
    assert all(layers[i + 1]["x"] == layers[i]["x_out"] for i in range(3))  # one chain
    assert not [r for r in be.refusals if r["pattern"] == "mhc_layer"]
    plan = be.reports[0].recompute_plan
    assert [b["layers"] for b in plan] == [[0, 1], [2, 3]]
    # the projections (an einsum, a matmul with a vector) are rebuilt, not kept: kept, their
    # ATen form would keep a copy of the normalised stream
    assert all(len(b["rebuilt_per_token"]) == 4 and not b["kept_per_token"] for b in plan)


@PACKAGE
def test_package_post_and_aggregate_fused_mapping_refused_equal_to_eager():
    m = _package_model()
    x = torch.randn(2, 8, 32, requires_grad=True)
    gm, ex = dynamo_graph(m, x)
    params = list(m.parameters())
    want = outputs_and_grads(m, [x], [x] + params)
    records, report = run_dynamo_passes(gm, ex)
    for pattern in ("mhc_post", "mhc_aggregate"):
        assert [mm["layer"] for mm in matches(records, pattern)] == [0, 1, 2, 3], pattern
        assert len(op_nodes(gm, pattern)) == 4
        assert all(mm["probe_rel_err"] < 1e-4 for mm in matches(records, pattern))
        # streams folded into the batch: [(B·n), S, C] holds [B, n, S, C]
        assert all(mm["memory_order"] == [0, 2, 1, 3] for mm in matches(records, pattern))
    assert all(mm["transpose_res"] for mm in matches(records, "mhc_post"))  # '... s t' mixes with H_resᵀ
    assert not op_nodes(gm, "mhc_mapping")
    refused = refusals(records, "mhc_mapping")
    assert [r["layer"] for r in refused] == [0, 1, 2, 3]
    assert not [r for r in refusals(records) if r["pattern"] != "mhc_mapping"]
    for reason in ("normalised on its own", "projection of its own", "F.normalize(m, p=1)",
                   "exp(z − max z)"):
        assert all(reason in r["reason"] for r in refused), (reason, refused[0]["reason"])
    assert [b["layers"] for b in report.recompute_plan] == [[0, 1], [2, 3]]
    got = outputs_and_grads(gm, ex, [x] + params)
    assert_close([got[0]], [want[0]], 1e-5, "out")
    assert_close(got[1], want[1], 1e-4, "grad")


@PACKAGE
def test_package_original_hyper_connections_not_taken_for_mhc():
    """The package's default class (the README's unprefixed function): tanh mappings, no
    Sinkhorn. Compiled as any other code, equal to eager."""
    torch.manual_seed(0)
    m = PackageTransformer(manifold=False)
    x = torch.randn(2, 8, 32)
    be = Collect(compiler="aot_eager")
    out = torch.compile(m, backend=be)(x)
    assert not [mm for mm in be.matches if mm["pattern"].startswith(("mhc_", "hc_block"))]
    assert_close([out], [m(x)], 1e-5, "out")


@PACKAGE
def test_package_hyper_connection_dropout_ends_the_chain():
    """mHC(dropout=p) drops out the whole new stream after the residual add: the next layer reads
    a random function of x', so the layers do not chain (each is its own block, the dropout's
    output its saved input); dropout(p=0), the default, is an identity and they do."""
    torch.manual_seed(0)
    init_hc, expand, reduce = hyper_connections.mc_get_init_and_expand_reduce_stream_functions(
        4, sinkhorn_iters=4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([init_hc(dim=32, branch=FeedForward(32), layer_index=i,
                                                 dropout=0.1) for i in range(3)])

        def forward(self, x):
            x = expand(x)
            for b in self.blocks:
                x = b(x)
            return reduce(x)

    be = Collect(compiler="aot_eager", disable_passes=("hc_fuse",))
    torch.compile(Net(), backend=be)(torch.randn(2, 8, 32))
    layers = [x for x in be.matches if x["pattern"] == "mhc_layer"]
    assert [x["layer"] for x in layers] == [0, 1, 2]
    assert [b["layers"] for b in be.reports[0].recompute_plan] == [[0], [1], [2]]


# ----------------------------------------------------------------------------------------------
# DeepSeek-V4 style: [B, S, n, C] with einsums, written as such code is written


def hc_split_sinkhorn(mixes, hc_scale, hc_base, n: int, iters: int, eps: float, mixing: str):
    pre, post, comb = mixes.split([n, n, n * n], dim=-1)
    pre = torch.sigmoid(pre * hc_scale[0] + hc_base[:n]) + eps
    post = 2 * torch.sigmoid(post * hc_scale[1] + hc_base[n:2 * n])
    comb = (comb * hc_scale[2] + hc_base[2 * n:]).unflatten(-1, (n, n))
    if mixing == "tanh":  # not Sinkhorn: the original Hyper-Connections' dynamic mixing
        return pre, post, torch.eye(n) + torch.tanh(comb)
    if mixing == "l1_signed":  # F.normalize(p=1) alternation of a signed matrix: Σ|m| is not Σ m
        comb = torch.tanh(comb)
        for _ in range(iters):
            comb = F.normalize(comb, p=1, dim=-1)
            comb = F.normalize(comb, p=1, dim=-2)
        return pre, post, comb
    comb = comb.softmax(-1) + eps
    if mixing == "softmax":  # row-stochastic only
        return pre, post, comb
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        if mixing != "rows":  # "rows": one column normalisation, then rows only
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


class V4Block(nn.Module):
    """One transformer block with an mHC hyper-connection around attention and around the MLP."""

    def __init__(self, dim, heads, n, iters, res_eq, mixing, dropout):
        super().__init__()
        self.n, self.iters, self.res_eq, self.mixing = n, iters, res_eq, mixing
        self.norm_eps, self.hc_eps = 1e-6, 1e-6
        self.attn, self.ffn = Attention(dim, heads, dropout, norm=False), FeedForward(dim, dropout, norm=False)
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        mix = n * n + 2 * n
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", nn.Parameter(torch.randn(mix, n * dim) * (n * dim) ** -0.5))
            setattr(self, f"hc_{part}_base", nn.Parameter(0.5 * torch.randn(mix)))
            setattr(self, f"hc_{part}_scale", nn.Parameter(torch.empty(3).uniform_(0.5, 1.5)))

    def hc_pre(self, x, hc_fn, hc_scale, hc_base):
        shape, dtype = x.size(), x.dtype
        x = x.flatten(2).float()
        rsqrt = torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)
        mixes = F.linear(x, hc_fn) * rsqrt
        pre, post, comb = hc_split_sinkhorn(mixes, hc_scale, hc_base, self.n, self.iters,
                                            self.hc_eps, self.mixing)
        y = torch.einsum("bsi,bsic->bsc", pre, x.view(shape))
        return y.to(dtype), post, comb

    def hc_post(self, f, residual, post, comb):
        y = torch.einsum("bsi,bsc->bsic", post, f) + torch.einsum(self.res_eq, comb, residual)
        return y.type_as(f)

    def forward(self, x):  # [B, S, n, C]
        residual = x
        y, post, comb = self.hc_pre(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        x = self.hc_post(self.attn(self.attn_norm(y)), residual, post, comb)
        residual = x
        y, post, comb = self.hc_pre(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        return self.hc_post(self.ffn(self.ffn_norm(y)), residual, post, comb)


class V4Transformer(nn.Module):
    def __init__(self, dim=32, depth=2, heads=2, n=4, iters=4, res_eq="bsij,bsjc->bsic",
                 mixing="sinkhorn", dropout=0.0):
        super().__init__()
        self.n = n
        self.blocks = nn.ModuleList([V4Block(dim, heads, n, iters, res_eq, mixing, dropout)
                                     for _ in range(depth)])
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, dim, bias=False)

    def forward(self, x):  # [B, S, C]
        h = x.unsqueeze(2).repeat(1, 1, self.n, 1)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h.mean(2)))


RES_EQS = ["bsij,bsjc->bsic", "bsji,bsjc->bsic"]   # H_res·x, H_resᵀ·x


def _v4_model(**kwargs):
    torch.manual_seed(0)
    return V4Transformer(**kwargs)


@pytest.mark.parametrize("res_eq", RES_EQS)
def test_v4_einsum_form_detected_fused_and_equal_to_eager(res_eq):
    m = _v4_model(res_eq=res_eq)
    x = torch.randn(2, 8, 32, requires_grad=True)
    gm, ex = dynamo_graph(m, x)
    params = list(m.parameters())
    want = outputs_and_grads(m, [x], [x] + params)
    records, report = run_dynamo_passes(gm, ex)
    assert not refusals(records), refusals(records)
    layers = matches(records, "mhc_layer")
    assert [mm["layer"] for mm in layers] == [0, 1, 2, 3]
    assert all(not mm["combined"] and mm["stream_norm"] is None for mm in layers)
    for pattern in OPS:
        assert [mm["layer"] for mm in matches(records, pattern)] == [0, 1, 2, 3], pattern
        assert len(op_nodes(gm, pattern)) == 4, pattern
        assert all(mm["probe_rel_err"] < 1e-4 for mm in matches(records, pattern))
    assert all(mm["transpose_res"] == (res_eq == "bsji,bsjc->bsic") for mm in matches(records, "mhc_post"))
    mapping = matches(records, "mhc_mapping")[0]
    # softmax(-1)+ε start, the first normalisation over the columns, 1 + 2·3 normalisations,
    # the norm multiplied (rsqrt) into the projection before its split
    assert mapping["init"] == "softmax" and not mapping["row_first"] and mapping["sinkhorn_steps"] == 7
    assert not mapping["r_divides"] and mapping["offsets"] == [0, 4, 8]
    assert [b["layers"] for b in report.recompute_plan] == [[0, 1], [2, 3]]
    # the kept per-token inputs: the projection (a linear), the mean of v² and the norm computed
    # from it alone (+ ε, rsqrt), which would otherwise be rebuilt by a kernel of its own
    for b in report.recompute_plan:
        kinds = sorted(name.rstrip("_0123456789") for name in b["kept_per_token"])
        assert kinds == ["add"] * 2 + ["linear"] * 2 + ["mean"] * 2 + ["rsqrt"] * 2, b
        assert not b["rebuilt_per_token"], b
    got = outputs_and_grads(gm, ex, [x] + params)
    assert_close([got[0]], [want[0]], 1e-5, "out")
    assert_close(got[1], want[1], 1e-4, "grad")


@pytest.mark.parametrize("mixing", ["softmax", "rows", "tanh", "l1_signed"])
def test_v4_near_misses_not_taken_for_mhc(mixing):
    """A mixing matrix that is not Sinkhorn-normalised (row softmax only; one column
    normalisation then rows only; the original Hyper-Connections' I + tanh; F.normalize(p=1)
    alternating on a signed matrix) is no hyper-connection hc knows: nothing is detected, fused or
    planned, and the compiled model equals eager."""
    m = _v4_model(mixing=mixing, depth=1)
    x = torch.randn(2, 8, 32)
    be = Collect(compiler="aot_eager")
    out = torch.compile(m, backend=be)(x)
    assert not [mm for mm in be.matches if mm["pattern"].startswith(("mhc_", "hc_block"))], be.matches
    assert not be.reports[0].recompute_plan
    assert_close([out], [m(x)], 1e-5, "out")


# ----------------------------------------------------------------------------------------------
# Inductor: the plan's saved bytes, bit-identical gradients with dropout, equality with eager


def _inductor_runs(model):
    """backend="inductor", then hc with recompute off and block (fusion on), dropout 0.1."""
    x = torch.randn(2, 16, 32, requires_grad=True)
    runs = {"inductor": train_step(model, x, backend="inductor")}
    for name, opts in {"off": {"hc_recompute": "off"}, "block": {}}.items():
        runs[name] = train_step(model, x, **opts)
    return runs


def _check_runs(runs, form):
    (b_off, be_off, out_off, g_off), (b_blk, be_blk, out_blk, g_blk) = runs["off"], runs["block"]
    report = be_blk.reports[0]
    assert not report.fallback
    assert [b["layers"] for b in report.recompute_plan] == [[0, 1], [2, 3]]
    for measured, be in ((b_off, be_off), (b_blk, be_blk)):
        assert measured == be.reports[0].saved_bytes["bytes"]      # the plan is what autograd keeps
    # dropout masks are never replayed: bit for bit what no recompute gives
    assert torch.equal(out_blk, out_off)
    differ = [i for i, (a, b) in enumerate(zip(g_blk, g_off)) if not torch.equal(a, b)]
    assert not differ, f"{form}: gradients {differ} of {len(g_off)} differ from hc_recompute='off'"
    assert b_blk < b_off


def _stream_sized_saved(report, tokens=2 * 16, n=4, C=32):
    """The saved tensors that hold a stream: tokens·n·C values, C last (the report lists
    `name:(shape):dtype`; the MLP's [tokens, 4C] has as many values, not C last)."""
    out = []
    for entry in report.saved_bytes["names"]:
        sizes = [int(v) for v in re.findall(r"\d+", entry.split(":")[1])]
        if sizes and sizes[-1] == C and math.prod(sizes) == tokens * n * C:
            out.append(entry)
    return out


def _check_equal_to_eager(model):
    """fp32, no dropout: the compiled step (fusion and block recompute) against eager."""
    x = torch.randn(2, 16, 32, requires_grad=True)
    _, be, out, grads = train_step(model, x)
    assert [b["layers"] for b in be.reports[0].recompute_plan] == [[0, 1], [2, 3]]
    want = outputs_and_grads(model, [x], [x] + list(model.parameters()))
    assert_close([out], [want[0]], 1e-4, "out")
    assert_close(grads, want[1], 1e-4, "grad")


@pytest.fixture(scope="module")
def package_runs():
    if hyper_connections is None:
        pytest.skip("needs the hyper-connections package: pip install hyper-connections==0.4.11")
    return _inductor_runs(_package_model(dropout=0.1))


@pytest.fixture(scope="module")
def v4_runs():
    return _inductor_runs(_v4_model(dropout=0.1))


@PACKAGE
def test_package_inductor_block_recompute_bit_identical(package_runs):
    _check_runs(package_runs, "package")
    report = package_runs["block"][1].reports[0]
    # kept: the block inputs (the first is the graph's input), every f, and each layer's per-stream
    # norm output (see HCRecomputePass): 2 block inputs + 4 norms would be 6 stream-sized tensors
    assert all(len(b["kept_stream_norms"]) == 2 for b in report.recompute_plan)
    assert len(_stream_sized_saved(report)) == 1 + 4, report.saved_bytes["names"]


@PACKAGE
def test_package_saved_bytes_meet_the_issue_target(package_runs):
    b_ind, b_blk = package_runs["inductor"][0], package_runs["block"][0]
    assert b_blk <= SAVED_RATIO_TARGET * b_ind, f"{b_blk} vs Inductor's {b_ind} ({b_blk / b_ind:.2f}x)"


@PACKAGE
def test_package_inductor_step_equal_to_eager():
    _check_equal_to_eager(_package_model())


def test_v4_inductor_block_recompute_bit_identical(v4_runs):
    _check_runs(v4_runs, "v4")
    report = v4_runs["block"][1].reports[0]
    # the only stream kept is block 2's input: block 1 starts at the embedding, whose
    # `repeat` to n streams is rebuilt (recompute.expansion_source)
    assert report.recompute_plan[0]["saved"][0] == "l_x_"
    assert len(_stream_sized_saved(report)) == 1, report.saved_bytes["names"]


def test_v4_saved_bytes_meet_the_issue_target(v4_runs):
    b_ind, b_blk = v4_runs["inductor"][0], v4_runs["block"][0]
    assert b_blk <= SAVED_RATIO_TARGET * b_ind, f"{b_blk} vs Inductor's {b_ind} ({b_blk / b_ind:.2f}x)"


def test_v4_inductor_step_equal_to_eager():
    _check_equal_to_eager(_v4_model(res_eq="bsji,bsjc->bsic"))
