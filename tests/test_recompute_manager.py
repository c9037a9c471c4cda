"""The eager block recompute manager (hccompile.recompute) on a small mHC model.

The model follows REFERENCE.md §2: n residual streams, flattened RMS norm, one projection to
n²+2n, α scalars, sigmoid / 2·sigmoid, Sinkhorn-Knopp (20 iterations), aggregate, apply_h_res,
apply_h_post, bias-dropout-add (p=0.1), causal softmax attention with attention dropout and a
GELU MLP as the sublayer functions F.
"""
from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hccompile.debug.memory import SavedStorages
from hccompile.recompute import (
    BlockRecomputeManager,
    CheckpointWithoutOutput,
    MHCSublayer,
    RecomputeConfig,
    RecomputeError,
    mhc_block_forward,
)

N, C, HEADS, B, S, P = 4, 32, 2, 2, 16, 0.1
LAYERS, LAYERS_PER_BLOCK = 4, 2

CALLS: list[str] = []  # every mHC function call, by name, in call order


def _rms(t, w=None, eps=1e-6):
    out = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
    return out if w is None else out * w


def sinkhorn(logits, iters=20):
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)   # rows
        m = m / m.sum(-2, keepdim=True)   # columns
    return m


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C, bias=False)
        self.proj = nn.Linear(C, C)

    def forward(self, z):
        b, s, _ = z.shape
        q, k, v = self.qkv(z).view(b, s, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (C // HEADS) ** -0.5
        att = att.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        att = F.dropout(att.softmax(-1), P, self.training)
        return self.proj((att @ v).transpose(1, 2).reshape(b, s, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, z):
        return self.fc2(F.gelu(self.fc1(z)))


class MHCSub(nn.Module):
    """Hyper-connection parameters of one sublayer around its F."""

    def __init__(self, fn: nn.Module, name: str):
        super().__init__()
        self.name, self.fn = name, fn
        self.phi = nn.Parameter(torch.randn(N * C, N * N + 2 * N) / math.sqrt(N * C))
        self.alpha = nn.Parameter(torch.full((3,), 0.01) + 0.05 * torch.rand(3))
        self.hc_bias = nn.Parameter(0.1 * torch.randn(N * N + 2 * N))
        self.norm_w = nn.Parameter(1 + 0.1 * torch.randn(C))
        self.out_bias = nn.Parameter(0.1 * torch.randn(C))

    def compute_mappings(self, x):                     # x [B, S, n, C]
        CALLS.append(f"{self.name}.compute_mappings")
        v = x.flatten(-2)
        r = v.norm(dim=-1, keepdim=True) / math.sqrt(v.shape[-1])
        pre, post, res = (v @ self.phi).split([N, N, N * N], -1)
        b_pre, b_post, b_res = self.hc_bias.split([N, N, N * N])
        h_pre = torch.sigmoid(self.alpha[0] * pre / r + b_pre)
        h_post = 2 * torch.sigmoid(self.alpha[1] * post / r + b_post)
        h_res = sinkhorn((self.alpha[2] * res / r + b_res).unflatten(-1, (N, N)))
        return h_pre, h_post, h_res

    def aggregate(self, x, h_pre):
        CALLS.append(f"{self.name}.aggregate")
        return (h_pre.unsqueeze(-1) * x).sum(-2)

    def apply_h_res(self, h_res, x):
        CALLS.append(f"{self.name}.apply_h_res")
        return h_res @ x

    def norm(self, y):
        CALLS.append(f"{self.name}.norm")
        return _rms(y, self.norm_w)

    def run_fn(self, z):
        CALLS.append(f"{self.name}.fn")
        return self.fn(z)

    def apply_h_post(self, f, h_post):
        CALLS.append(f"{self.name}.apply_h_post")
        return h_post.unsqueeze(-1) * f.unsqueeze(-2)

    def bda(self, post, mixed):
        CALLS.append(f"{self.name}.bda")
        return mixed + F.dropout(post + self.out_bias, P, self.training)

    def sublayer(self) -> MHCSublayer:
        return MHCSublayer(self.compute_mappings, self.aggregate, self.apply_h_res, self.norm, self.run_fn,
                           self.apply_h_post, self.bda, name=self.name.split(".")[-1])

    def plain(self, x):  # written out independently of the helper
        h_pre, h_post, h_res = self.compute_mappings(x)
        y = self.aggregate(x, h_pre)
        mixed = self.apply_h_res(h_res, x)
        f = self.run_fn(self.norm(y))
        return self.bda(self.apply_h_post(f, h_post), mixed)


class TinyMHC(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList([MHCSub(Attention(), f"layer{i}.attn"), MHCSub(MLP(), f"layer{i}.mlp")])
            for i in range(LAYERS))
        self.final_w = nn.Parameter(torch.ones(C))
        self.head = nn.Linear(C, C)

    def blocks(self):
        return [self.layers[i:i + LAYERS_PER_BLOCK] for i in range(0, LAYERS, LAYERS_PER_BLOCK)]

    def forward(self, x, config: RecomputeConfig | None = None, managers: list | None = None):
        h = x.unsqueeze(-2).expand(*x.shape[:-1], N, C).contiguous()  # input_expand
        for bi, block in enumerate(self.blocks()):
            if config is None:
                for layer in block:
                    for sub in layer:
                        h = sub.plain(h)
            else:
                mgr = BlockRecomputeManager(config, name=f"block{bi}")
                if managers is not None:
                    managers.append(mgr)
                h = mhc_block_forward(h, [[sub.sublayer() for sub in layer] for layer in block], manager=mgr)
        return self.head(_rms(h.mean(-2), self.final_w))  # output_contract, final norm, head


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add contention on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyMHC().train()


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, S, C, generator=g), torch.randn(B, S, C, generator=g)


def run(model, data, config=None, *, seed=123, backward=True, managers=None):
    """Forward (+ backward) from a fixed RNG seed; returns output, grads (params + input), RNG after."""
    x0, w = data
    model.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = model(x, config, managers)
    if not backward:
        return out, x
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["<input>"] = x.grad.clone()
    return out.detach(), grads, torch.get_rng_state()


CONFIGS = [RecomputeConfig(g, ln, bda) for g, ln, bda in itertools.product(("block", "layer"), (True, False),
                                                                            (True, False))]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.granularity}-ln{int(c.include_layernorm)}"
                                                          f"-bda{int(c.include_bda)}")
def test_gradients_bit_exact(model, data, config):
    out_ref, g_ref, rng_ref = run(model, data)
    mgrs = []
    out, g, rng = run(model, data, config, managers=mgrs)
    assert torch.equal(out, out_ref)
    assert g.keys() == g_ref.keys()
    bad = [n for n in g if not torch.equal(g[n], g_ref[n])]
    assert not bad, f"gradients differ: {bad}"
    assert torch.equal(rng, rng_ref), "the global RNG state after backward differs"
    for m in mgrs:  # each checkpoint recomputed once; groups last-to-first, each in forward order
        assert m.recompute_log == [c.name for grp in reversed(m.groups) for c in grp]


def test_parameters_get_gradients_when_the_input_does_not_require_grad(model, data):
    """Frozen embeddings: no checkpoint input requires grad at block 0, the closed-over
    parameters (phi, alpha, ...) must still get their gradients."""
    grads = []
    for config in (None, RecomputeConfig()):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(4)
        (model(data[0], config) * data[1]).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(g is not None for g in grads[1].values())
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_integer_output_saved_by_a_later_op_is_refilled():
    src = _leaf(4, 8)
    scores = _leaf(4, 8)
    with BlockRecomputeManager(name="blk") as m:
        idx = m.checkpoint("argmax", lambda t: t.argmax(-1, keepdim=True), scores * 1)
        out = torch.gather(src, 1, idx) * 2      # gather saves idx (discarded, refilled)
        m.finalize(out)
    assert idx.untyped_storage().nbytes() == 0 and not idx.requires_grad
    out.sum().backward()
    assert torch.equal(src.grad, torch.zeros(4, 8).scatter_(1, scores.argmax(-1, keepdim=True), 2.0))


def _held_bytes(model, thunk, managers=(), exclude=()):
    """Bytes kept for backward after the forward: distinct storages saved by autograd (recorded at
    pack time, measured after the forward, so discarded outputs count 0) plus what the checkpoints
    keep themselves (outputs, RNG snapshots). Parameters excluded."""
    with SavedStorages(exclude=[*model.parameters(), *exclude]) as saved:
        result = thunk()
    for m in managers:
        saved.add(m.held_storages())
    return result, saved.nbytes


def _saved_by(model, fn, *inputs, count_inputs=False):
    """Bytes plain autograd saves for fn(*inputs) (inputs excluded unless count_inputs)."""
    inputs = [t.detach().requires_grad_(True) for t in inputs]
    exclude = () if count_inputs else inputs
    return _held_bytes(model, lambda: fn(*inputs), exclude=exclude)[1]


def _expected_bytes(model, config: RecomputeConfig) -> int:
    """What the manager should keep, from the parts (REFERENCE §2: block input + each F output):
    block inputs, each F output and F's own saved tensors, the hook tails' BDA saves, the RNG
    snapshots of checkpointed BDAs, the head; plus the norm's saves and output when norms are not
    recomputed, and the layer tails (layer granularity) or all BDA outputs (include_bda=False)."""
    stream, z = torch.randn(B, S, N, C), torch.randn(B, S, C)
    rng = torch.get_rng_state().nbytes              # a CPU generator snapshot
    sub0 = model.layers[0][0]
    bda = _saved_by(model, sub0.bda, stream, stream)  # dropout's mask
    nblocks, per_block = LAYERS // LAYERS_PER_BLOCK, 2 * LAYERS_PER_BLOCK
    tails_per_block = LAYERS_PER_BLOCK if config.granularity == "layer" else 1
    saved_bdas = per_block if not config.include_bda else tails_per_block   # per block
    total = nblocks * stream.nbytes                               # block inputs
    total += nblocks * (saved_bdas - 1) * stream.nbytes           # saved BDA outputs (not the last)
    total += nblocks * saved_bdas * bda + nblocks * (per_block - saved_bdas) * rng
    for layer in model.layers:
        for sub in layer:
            total += z.nbytes + _saved_by(model, sub.run_fn, z)   # F output and F's saves
            if not config.include_layernorm:
                total += z.nbytes + _saved_by(model, sub.norm, z)  # norm output and its saves
    total += _saved_by(model, lambda h: model.head(_rms(h.mean(-2), model.final_w)), stream, count_inputs=True)
    return total


def test_discarded_storages_and_saved_bytes(model, data):
    (out_p, _), plain = _held_bytes(model, lambda: run(model, data, backward=False))
    mgrs = []
    (out_m, x), managed = _held_bytes(model, lambda: run(model, data, RecomputeConfig(), backward=False,
                                                          managers=mgrs), mgrs)
    # every checkpoint output is empty between forward and backward, and stays a live tensor
    ckpts = [c for m in mgrs for c in m.checkpoints]
    assert len(ckpts) == LAYERS * 2 * 6 - len(mgrs)  # 6 per sublayer, minus each block's tail BDA
    assert all(c.is_discarded and all(s.nbytes() == 0 for s in c._storages) for c in ckpts)
    assert all(t.untyped_storage().nbytes() == 0 for c in ckpts for t in c.outputs)
    discarded = sum(m.stats()["discarded_bytes"] for m in mgrs)
    print(f"\nsaved for backward: plain {plain} B, block recompute {managed} B "
          f"(drop {plain - managed} B, {plain / managed:.2f}x); checkpoint outputs freed {discarded} B; "
          f"RNG snapshots {sum(m.stats()['rng_bytes'] for m in mgrs)} B")
    assert managed == _expected_bytes(model, RecomputeConfig())
    assert managed < plain / 3
    # backward after the measurement still gives the plain gradients
    (out_m * data[1]).sum().backward()
    assert torch.equal(out_m.detach(), out_p.detach())
    # after backward the checkpoints hold no output storage any more (plain autograd lifetime)
    assert all(not c._storages for c in ckpts)


@pytest.mark.parametrize("config", [RecomputeConfig("layer"), RecomputeConfig(include_layernorm=False),
                                    RecomputeConfig(include_bda=False), RecomputeConfig("layer", False, False)],
                         ids=["layer", "ln0", "bda0", "layer-ln0-bda0"])
def test_knobs_change_saved_bytes(model, data, config):
    mgrs = []
    _, held = _held_bytes(model, lambda: run(model, data, config, backward=False, managers=mgrs), mgrs)
    print(f"\n{config}: {held} B")
    assert held == _expected_bytes(model, config) and held > _expected_bytes(model, RecomputeConfig())


def _global_name(ckpt_name):
    """'block1.layer0.attn.norm' -> 'layer2.attn.norm' (the name CALLS records)."""
    b, l, rest = re.fullmatch(r"block(\d+)\.layer(\d+)\.(.*)", ckpt_name).groups()
    return f"layer{int(b) * LAYERS_PER_BLOCK + int(l)}.{rest}"


def test_recompute_runs_in_forward_order_before_the_block_backward(model, data):
    mgrs, events = [], []
    x0, w = data
    x = x0.clone().requires_grad_(True)
    torch.manual_seed(5)
    CALLS.clear()
    out = model(x, RecomputeConfig(), mgrs)
    fwd_calls = list(CALLS)
    checkpointed = [[c.name for c in m.checkpoints] for m in mgrs]
    for m in mgrs:  # backward reaching each F output, after the hooks ran
        for c in m.checkpoints:
            if c.name.endswith("apply_h_post"):
                f = c._ctx_ref().saved_tensors[0]
                f.register_hook(lambda g, n=c.name: events.append(("F-grad", n)))
    CALLS.clear()
    orig = [m.recompute_group for m in mgrs]
    for m, o in zip(mgrs, orig):
        m.recompute_group = (lambda gi, m=m, o=o: (events.append(("recompute", m.name)), o(gi)))
    (out * w).sum().backward()
    bwd_calls = list(CALLS)
    # the mHC functions re-run in backward are exactly the checkpointed ones: block 1 then block 0,
    # each block in forward order; F never re-runs
    names = [_global_name(n) for n in checkpointed[1] + checkpointed[0]]
    assert bwd_calls == names
    assert not any(c.endswith(".fn") for c in bwd_calls)
    fwd_names = [_global_name(n) for n in checkpointed[0] + checkpointed[1]]
    assert [n for n in fwd_calls if n in set(fwd_names)] == fwd_names  # the same order as the forward's
    # one recompute per block, and before any F output of that block receives its gradient
    order = events
    for m in mgrs:
        i_rec = order.index(("recompute", m.name))
        f_grads = [i for i, e in enumerate(order) if e[0] == "F-grad" and e[1].startswith(m.name)]
        assert f_grads and min(f_grads) > i_rec
    assert [e[1] for e in order if e[0] == "recompute"] == ["block1", "block0"]


def test_rng_restore_dropout_inside_checkpoint():
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    ck = CheckpointWithoutOutput(None, name="dropout")
    y = ck.checkpoint(lambda t: F.dropout(t * 2, 0.5), x)
    kept = y.detach().clone()
    z = y * 3                          # saves nothing of y; but y itself gets refilled
    state_before = torch.get_rng_state()
    ck.discard_output_and_register_recompute(z)
    assert y.untyped_storage().nbytes() == 0
    torch.rand(1000)                   # move the global generator on
    state_mid = torch.get_rng_state()
    z.sum().backward()
    assert torch.equal(y.detach(), kept)           # refilled in place, released to y after backward
    assert torch.equal(torch.get_rng_state(), state_mid)  # recompute restored the global RNG state
    assert not torch.equal(state_before, state_mid)
    assert torch.equal(x.grad, (kept != 0).float() * 2 * 2 * 3)  # dropout(0.5) scales kept by 2

    # refilled values equal the forward ones, and the mask matches
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    ck = CheckpointWithoutOutput(None)
    y = ck.checkpoint(lambda t: F.dropout(t, 0.5), x)
    kept = y.detach().clone()
    ck.discard_output()
    torch.rand(10)
    ck.recompute()
    assert torch.equal(y.detach(), kept)
    assert ck._rng is not None and ck._rng.cpu is not None
    ck_no_rng = CheckpointWithoutOutput(None)
    ck_no_rng.checkpoint(torch.sin, x)
    assert ck_no_rng._rng is None      # no draw, no snapshot kept


def test_granularity_changes_hooks(model, data):
    for gran in ("block", "layer"):
        mgrs = []
        out, x = run(model, data, RecomputeConfig(gran), backward=False, managers=mgrs)
        for m in mgrs:
            hooks = [h for h in m.hooks if h.handle is not None]
            assert all(h.shape == (B, S, N, C) and h.grad_fn_name == "AddBackward0" for h in hooks)  # a BDA add
            if gran == "block":
                assert len(hooks) == 1 and len(m.groups) == 1
                # every layer's last BDA but the block's last is checkpointed
                assert sum(c.name.endswith("mlp.bda") for c in m.checkpoints) == LAYERS_PER_BLOCK - 1
            else:
                assert len(hooks) == LAYERS_PER_BLOCK and len(m.groups) == LAYERS_PER_BLOCK
                assert not any(c.name.endswith("mlp.bda") for c in m.checkpoints)
                for gi, h in enumerate(hooks):  # one group per layer, hooked on that layer's output
                    assert {n.split(".")[1] for n in h.checkpoint_names} == {f"layer{gi}"}
        (out * data[1]).sum().backward()
        if gran == "layer":  # layer 1's group recomputed before layer 0's
            log = mgrs[0].recompute_log
            assert log.index("block0.layer1.attn.compute_mappings") < log.index("block0.layer0.attn.compute_mappings")

    # the hook sits on the tail tensor itself (identity), which keeps its storage
    sub = [[s.sublayer() for s in layer] for layer in model.layers[:2]]
    for gran in ("block", "layer"):
        h0 = torch.randn(B, S, N, C, requires_grad=True)
        tails = []
        mgr = BlockRecomputeManager(gran)
        orig_end = mgr.end_layer
        mgr.end_layer = lambda t: (tails.append(t), orig_end(t))[1]
        out = mhc_block_forward(h0, sub, manager=mgr)
        hooked = [h.tensor for h in mgr.hooks if h.handle is not None]
        expected = [out] if gran == "block" else tails
        assert len(hooked) == len(expected) and all(a is b for a, b in zip(hooked, expected))
        assert all(t.untyped_storage().nbytes() > 0 for t in hooked)
        out.sum().backward()


def test_include_knobs_change_what_is_recomputed(model, data):
    def ops(cfg):
        mgrs = []
        out, _ = run(model, data, cfg, backward=False, managers=mgrs)
        (out * data[1]).sum().backward()
        ops_seen = {c.name.rsplit(".", 1)[1] for m in mgrs for c in m.checkpoints}
        return ops_seen, [n for m in mgrs for n in m.recompute_log]

    all_ops = {"compute_mappings", "aggregate", "apply_h_res", "norm", "apply_h_post", "bda"}
    assert ops(RecomputeConfig())[0] == all_ops
    names, log = ops(RecomputeConfig(include_layernorm=False))
    assert names == all_ops - {"norm"} and not any(n.endswith(".norm") for n in log)
    names, log = ops(RecomputeConfig(include_bda=False))
    assert names == all_ops - {"bda"} and not any(n.endswith(".bda") for n in log)


def test_no_grad_and_disabled_config_run_plain(model, data):
    mgrs = []
    with torch.no_grad():
        torch.manual_seed(3)
        out = model(data[0], RecomputeConfig(), mgrs)
        torch.manual_seed(3)
        ref = model(data[0])
    assert torch.equal(out, ref) and all(not m.checkpoints for m in mgrs)
    torch.manual_seed(3)
    x = data[0].clone().requires_grad_(True)
    h = x.unsqueeze(-2).expand(B, S, N, C).contiguous()
    h = mhc_block_forward(h, [[s.sublayer() for s in model.layers[0]]], RecomputeConfig(granularity=None))
    assert h.requires_grad


def test_retain_graph_second_backward_recomputes_again(model, data):
    x0, w = data
    grads = []
    for config in (None, RecomputeConfig()):
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        torch.manual_seed(9)
        loss = (model(x, config) * w).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([p.grad for p in model.parameters()] + [x.grad])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ---------------------------------------------------------------------------------------------
# dependency validation (design v1.1: persistent vs refillable inputs)
# ---------------------------------------------------------------------------------------------
def _leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def _double(t):
    return t * 2


def test_refillable_and_persistent_inputs_are_classified():
    x, w = _leaf(4, 8), _leaf(8, 8)
    with BlockRecomputeManager("block", name="b") as m:
        a = m.checkpoint("a", _double, x)
        f = a @ w                             # plain op: its output is persistent
        b = m.checkpoint("b", torch.add, a, f)
        out = b @ w
        m.finalize(out)
    ca, cb = m.checkpoints
    assert ca.persistent == [0] and ca.refillable == {}
    assert cb.refillable == {0: "a"} and cb.persistent == [1]
    out.sum().backward()
    assert m.recompute_log == ["a", "b"]


def test_error_input_from_another_block_after_it_was_discarded():
    x = _leaf(4, 8)
    with BlockRecomputeManager(name="block0") as m0:
        a = m0.checkpoint("a", _double, x)
        tail = a + 1
        m0.finalize(tail)
    with pytest.raises(RecomputeError, match=r"input 0 has a discarded .*checkpoint 'a' of manager 'block0'"):
        with BlockRecomputeManager(name="block1") as m1:
            m1.checkpoint("b", _double, a)


def test_error_input_from_another_open_block():
    x = _leaf(4, 8)
    m0 = BlockRecomputeManager(name="block0")
    a = m0.checkpoint("a", _double, x)            # explicit registration, m0 still open
    with pytest.raises(RecomputeError, match=r"output of checkpoint 'a', a checkpoint of a different block "
                                             r"manager 'block0'"):
        with BlockRecomputeManager(name="block1") as m1:
            m1.checkpoint("b", _double, a)


def test_error_input_from_unregistered_checkpoint():
    x = _leaf(4, 8)
    a = CheckpointWithoutOutput(None, name="free").checkpoint(_double, x)
    with pytest.raises(RecomputeError, match=r"checkpoint 'free', a standalone checkpoint"):
        with BlockRecomputeManager(name="blk") as m:
            m.checkpoint("b", _double, a)


def test_error_input_from_an_earlier_layer_group():
    x = _leaf(4, 8)
    with pytest.raises(RecomputeError, match=r"input 0 has a discarded .*checkpoint 'l0.a' of manager 'blk' "
                                             r"\(group 0\)"):
        with BlockRecomputeManager("layer", name="blk") as m:
            a = m.checkpoint("l0.a", _double, x)
            m.end_layer(a + 1)
            m.checkpoint("l1.b", _double, a)


def test_error_hook_tensor_is_a_checkpoint_output():
    x = _leaf(4, 8)
    with pytest.raises(RecomputeError, match=r"hook tensor is the output of checkpoint 'last'"):
        with BlockRecomputeManager(name="blk") as m:
            a = m.checkpoint("last", _double, x)
            m.finalize(a)


def test_error_output_aliases_input():
    x = _leaf(4, 8)
    with pytest.raises(RecomputeError, match=r"output 0 shares storage with input 0"):
        with BlockRecomputeManager(name="blk") as m:
            m.checkpoint("view", lambda t: t.view(8, 4), x)


def test_error_output_is_a_parameter():
    w = nn.Parameter(torch.randn(4, 8))
    with pytest.raises(RecomputeError, match=r"output 0 is a tensor that requires grad"):
        with BlockRecomputeManager(name="blk") as m:
            m.checkpoint("param", lambda t: w, _leaf(4, 8))


def test_error_missing_finalize():
    x = _leaf(4, 8)
    with pytest.raises(RecomputeError, match=r"not finalized .*call manager.finalize"):
        with BlockRecomputeManager(name="blk") as m:
            m.checkpoint("a", _double, x)


def test_error_checkpoint_not_upstream_of_hook_tensor():
    x, y = _leaf(4, 8), _leaf(4, 8)
    with pytest.raises(RecomputeError, match=r"\['side'\] are not upstream of the hook tensor"):
        with BlockRecomputeManager(name="blk") as m:
            side = m.checkpoint("side", _double, x)   # e.g. feeds an auxiliary loss
            main = m.checkpoint("main", _double, y)
            m.finalize(main * 3)
    assert side.requires_grad


def test_error_persistent_input_modified_in_place():
    x = _leaf(4, 8)
    with BlockRecomputeManager(name="blk") as m:
        h = x * 1
        a = m.checkpoint("a", torch.sin, h)
        out = a * 2
        m.finalize(out)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_error_join_after_finalize():
    x = _leaf(4, 8)
    with pytest.raises(RecomputeError, match="is finalized"):
        with BlockRecomputeManager(name="blk") as m:
            a = m.checkpoint("a", _double, x)
            m.finalize(a * 2)
            m.checkpoint("late", _double, x)


def test_docstring_example_runs_and_matches_plain():
    import hccompile.recompute as rc
    code = re.findall(r"```python\n(.*?)```", rc.__doc__, flags=re.S)[0]
    ns = {}
    exec(compile(code, "hccompile.recompute example", "exec"), ns)
    assert ns["mgr"].recompute_log == ["layer0.norm", "layer0.bda", "layer1.norm"]
    # the same computation without the manager
    torch.manual_seed(0)
    w = [torch.randn(16, 16, requires_grad=True) for _ in range(2)]
    x = torch.randn(4, 16, requires_grad=True)
    h = x
    for i in range(2):
        h = ns["bda"](ns["norm"](h) @ w[i], h)
    h.sum().backward()
    assert torch.equal(h, ns["h"]) and torch.equal(x.grad, ns["x"].grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(w, ns["w"]))
