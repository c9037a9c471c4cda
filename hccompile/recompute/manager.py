"""Eager block-level recomputation: `CheckpointWithoutOutput` and `BlockRecomputeManager`.

This is the eager (no `torch.compile`) form of the mHC recompute plan: run a function without
building its autograd graph, *free the storage of its output* once the block is done, and, when
backward reaches the block, re-run the function (same RNG draws, same autocast state) and write
the values back into the very storage that was freed. Every tensor that captured the output
(the next checkpoint's input, a tensor saved by a later autograd node such as the input of an
attention projection) sees the recomputed values; gradients then flow through the recomputed
graph.

Exactness: the gradients are bit-for-bit those of the plain eager run (dropout included) when
each checkpoint uses each of its tensor inputs in a single op, as the mHC functions do. A
checkpoint sums the gradient contributions of its inputs before returning them; an input used by
several ops inside a checkpoint *and* by ops outside it therefore gets its contributions added in
another order than plain autograd's (float addition is not associative): last-bit differences.

Vocabulary (from the design documents)
--------------------------------------
* **checkpoint**: one `CheckpointWithoutOutput` call. It keeps its inputs by reference (through
  `ctx.save_for_backward`, so `saved_tensors_hooks` see them and they are freed after backward),
  the RNG states it consumed (CPU, and CUDA when initialised; a snapshot is kept only when the
  function really drew random numbers), the autocast state, and the storages of its outputs.
* **refillable input**: an input that is the output of an earlier checkpoint of the *same
  recompute group*. It is discarded with the group and refilled by the recompute of its producer,
  which runs first because a group recomputes in forward order.
* **persistent input**: an input that no checkpoint produced (the block input, the attention or
  MLP output, parameters). It is never discarded.
* **recompute group**: the checkpoints that share one hook. `granularity="block"`: one group per
  block, one hook on the block's final tensor. `granularity="layer"`: one group per layer, one
  hook on each layer's final tensor (`end_layer`).
* **hook tensor**: the un-checkpointed tail of the group (e.g. the last bias-dropout-add output).
  Backward reaches it before it reaches anything that consumed the group's outputs; its hook
  recomputes the whole group in forward order.

Rules checked (a `RecomputeError` names the checkpoints involved):
  - an input whose storage is already discarded (a checkpoint output of a finalized group or
    block) is refused before the function runs;
  - a checkpoint created in a manager may only consume outputs of checkpoints of its own open
    group: outputs of another block's manager, of an earlier layer group, or of a standalone
    (unmanaged) checkpoint are refused, since their recompute is not ordered before ours;
  - an output sharing storage with an input (a view, the input itself) or requiring grad (a
    parameter returned as is) is refused: discarding it would free a persistent tensor;
  - the hook tensor must not be an output of the group and every checkpoint with an autograd
    node must be upstream of it (otherwise backward could reach a consumer of a discarded output
    before the hook fires);
  - `finalize` must be called before the `with` block ends;
  - recompute refuses inputs changed in place since the forward (autograd's version check).

Not detected: a plain (non-checkpoint) op that consumes a checkpoint output *after* the group was
finalized, or a consumer of a group output that backward reaches by a path not through the hook
tensor (e.g. an auxiliary loss on an intermediate). Double backward (`create_graph=True`) is not
supported. Reading a discarded output (printing it, using it in a plain op) before backward
refills it is undefined and can crash the process: the tensor has no memory behind it. After a
checkpoint's backward it drops its references to the refilled outputs, which then live only as
long as the tensors using them, as in plain autograd (`retain_graph=True`: the next backward
recomputes again to rebuild the graph).

Usage: see the example in `hccompile.recompute`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "RecomputeError",
    "RecomputeConfig",
    "CheckpointWithoutOutput",
    "BlockRecomputeManager",
    "HookRecord",
    "checkpoint_without_output",
    "current_manager",
]

GRANULARITIES = ("block", "layer")


class RecomputeError(RuntimeError):
    """A checkpoint plan that could not be recomputed correctly (raised before any wrong value)."""


@dataclasses.dataclass(frozen=True)
class RecomputeConfig:
    """The knobs of design v1.1.

    granularity: "block" (one unified hook per block), "layer" (one per layer), or None (no
        recompute: helpers run the plain functions).
    include_layernorm: norms are checkpointed (recomputed) when True, saved when False.
    include_bda: bias-dropout-adds are checkpointed when True (except the group's tail, which
        carries the hook), saved when False.
    """

    granularity: str | None = "block"
    include_layernorm: bool = True
    include_bda: bool = True

    def __post_init__(self):
        if self.granularity is not None and self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES} or None, got {self.granularity!r}")


# --------------------------------------------------------------------------------------------
# thread-local state: the stack of open managers, and whether we are inside a recompute
# --------------------------------------------------------------------------------------------
_tls = threading.local()


def _stack() -> list:
    s = getattr(_tls, "stack", None)
    if s is None:
        s = _tls.stack = []
    return s


def current_manager() -> "BlockRecomputeManager | None":
    """The innermost manager entered with `with` on this thread, or None."""
    s = _stack()
    return s[-1] if s else None


def _in_recompute() -> bool:
    return getattr(_tls, "recomputing", 0) > 0


@contextlib.contextmanager
def _recompute_scope():
    _tls.recomputing = getattr(_tls, "recomputing", 0) + 1
    try:
        yield
    finally:
        _tls.recomputing -= 1


# --------------------------------------------------------------------------------------------
# storages: identity and ownership (which checkpoint produced a storage)
# --------------------------------------------------------------------------------------------
def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, ... : no plain storage
        return None


def _key(t: torch.Tensor) -> int | None:
    s = _storage(t)
    return None if s is None else s._cdata


# storage key -> weakref to the checkpoint whose output lives there. A checkpoint holds its
# output storages strongly, so a key cannot be reused while its owner is alive.
_OWNERS: dict[int, weakref.ref] = {}


def _owner_of(t: torch.Tensor) -> "CheckpointWithoutOutput | None":
    k = _key(t)
    if k is None:
        return None
    ref = _OWNERS.get(k)
    owner = ref() if ref is not None else None
    if owner is None or k not in owner._storage_keys:
        return None
    return owner


def _drop_owner(key: int, ref: weakref.ref) -> None:
    if _OWNERS.get(key) is ref:
        del _OWNERS[key]


# --------------------------------------------------------------------------------------------
# RNG and autocast state
# --------------------------------------------------------------------------------------------
def _cuda_devices(tensors: Sequence[torch.Tensor]) -> list[int]:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    devs = {t.device.index for t in tensors if t.is_cuda and t.device.index is not None}
    devs.add(torch.cuda.current_device())
    return sorted(devs)


@dataclasses.dataclass
class _RngSnapshot:
    cpu: torch.Tensor | None
    cuda: dict[int, torch.Tensor]

    def tensors(self) -> list[torch.Tensor]:
        return ([self.cpu] if self.cpu is not None else []) + list(self.cuda.values())


def _get_rng(devices: Sequence[int]) -> _RngSnapshot:
    return _RngSnapshot(torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices})


def _consumed(before: _RngSnapshot, after: _RngSnapshot) -> _RngSnapshot | None:
    """Keep only the generators the function drew from (unchanged state = no draw)."""
    cpu = before.cpu if not torch.equal(before.cpu, after.cpu) else None
    cuda = {d: s for d, s in before.cuda.items() if not torch.equal(s, after.cuda[d])}
    return None if cpu is None and not cuda else _RngSnapshot(cpu, cuda)


@contextlib.contextmanager
def _rng_restored(snap: _RngSnapshot | None) -> Iterator[None]:
    """Run with the generators set to `snap`, then put back the states they had before."""
    if snap is None:
        yield
        return
    saved = _get_rng(list(snap.cuda))
    if snap.cpu is not None:
        torch.set_rng_state(snap.cpu)
    for d, s in snap.cuda.items():
        torch.cuda.set_rng_state(s, d)
    try:
        yield
    finally:
        if snap.cpu is not None:
            torch.set_rng_state(saved.cpu)
        for d in snap.cuda:
            torch.cuda.set_rng_state(saved.cuda[d], d)


def _autocast_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _get_autocast() -> tuple:
    return (tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _autocast_devices()),
            torch.is_autocast_cache_enabled())


@contextlib.contextmanager
def _autocast_as(state: tuple) -> Iterator[None]:
    per_device, cache = state
    with contextlib.ExitStack() as stack:
        for dev, enabled, dtype in per_device:
            stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=cache))
        yield


# --------------------------------------------------------------------------------------------
# the autograd node
# --------------------------------------------------------------------------------------------
class _CheckpointFunction(torch.autograd.Function):
    """forward: run under no_grad, save inputs by reference. backward: backward through the
    recomputed graph (recomputing now if no hook did it and the outputs are intact)."""

    @staticmethod
    def forward(ctx, ckpt: "CheckpointWithoutOutput", anchor: torch.Tensor, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors)
        ctx.ckpt = ckpt
        return ckpt._run_forward(ctx, tensors)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return (None, None) + ctx.ckpt._backward(ctx, grads)


@dataclasses.dataclass(frozen=True)
class _OutMeta:
    storage_index: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


_AUTO = object()
_ANCHOR: list[torch.Tensor] = []


def _grad_anchor() -> torch.Tensor:
    """An empty leaf that requires grad, passed to every checkpoint node: the node exists (and the
    parameters the function closes over get their gradients) even when no input requires grad."""
    if not _ANCHOR:
        _ANCHOR.append(torch.empty(0, requires_grad=True))
    return _ANCHOR[0]


class CheckpointWithoutOutput:
    """Checkpoint one function call whose output can be discarded and later refilled in place.

    `manager`: the `BlockRecomputeManager` to register with. Default: the innermost manager
    entered with `with` on this thread (auto-registration); pass `None` for a standalone
    checkpoint, which then needs `discard_output_and_register_recompute(hook_tensor)`.
    `name`: shown in errors and in the manager's logs. `preserve_rng_state`: replay the RNG
    draws of the forward (only the generators the function really drew from are kept).

    When grad mode is off, or inside a recompute, `checkpoint` just calls the function.
    """

    def __init__(self, manager: Any = _AUTO, *, name: str | None = None, preserve_rng_state: bool = True):
        self._manager_arg = manager
        self.name = name
        self.preserve_rng_state = preserve_rng_state
        self._manager_ref: weakref.ref | None = None
        self.group_index: int | None = None
        self.refillable: dict[int, str] = {}   # input index -> producing checkpoint's name
        self.persistent: list[int] = []        # input indices of persistent tensor inputs
        self._fn: Callable | None = None
        self._ctx_ref: weakref.ref | None = None
        self._state = "new"                    # new | live | passthrough
        self._storages: list[torch.UntypedStorage] = []
        self._storage_nbytes: list[int] = []
        self._output_nbytes = 0
        self._storage_keys: set[int] = set()
        self._out_meta: list[_OutMeta] = []
        self._out_refs: list[weakref.ref] = []
        self._has_node = False
        self._held_inputs: tuple | None = None
        self._persistent_keys: dict[int, int] = {}
        self._rng: _RngSnapshot | None = None
        self._autocast: tuple | None = None
        self._discarded = False
        self._ever_discarded = False
        self._recomputed: tuple | None = None
        self.recompute_count = 0

    # ---------------------------------------------------------------- forward
    @property
    def manager(self) -> "BlockRecomputeManager | None":
        return self._manager_ref() if self._manager_ref is not None else None

    def checkpoint(self, run_function: Callable, /, *args, **kwargs):
        """Run `run_function(*args, **kwargs)` without building its graph; return its output
        (a tensor or any pytree of tensors and constants)."""
        if self._state != "new":
            raise RecomputeError(f"checkpoint {self.name!r} was already used; create one per call")
        if not torch.is_grad_enabled() or _in_recompute():
            self._state = "passthrough"
            return run_function(*args, **kwargs)
        mgr = current_manager() if self._manager_arg is _AUTO else self._manager_arg
        self._manager_arg = None  # only a weak reference stays (no manager <-> checkpoint cycle)
        self._fn = run_function
        leaves, spec = tree_flatten((args, kwargs))
        tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in tensor_pos]
        self._leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self._tensor_pos, self._in_spec = tensor_pos, spec
        if mgr is not None:
            mgr._admit(self, run_function)  # names it, checks the manager is open
            mgr._classify_inputs(self, tensors)
        else:
            if self.name is None:
                self.name = getattr(run_function, "__name__", "checkpoint")
            _check_not_discarded(self, tensors)
            self.persistent = list(range(len(tensors)))
        self._devices = _cuda_devices(tensors)
        self._autocast = _get_autocast()
        flat_out = _CheckpointFunction.apply(self, _grad_anchor(), *tensors)
        if isinstance(flat_out, torch.Tensor):
            flat_out = (flat_out,)
        self._out_refs = [weakref.ref(t) for t in flat_out]
        self._has_node = any(t.requires_grad for t in flat_out)
        # no differentiable output: nothing keeps the node (and its saved inputs) alive; hold them here
        self._held_inputs = None if self._has_node else tuple(tensors)
        self._persistent_keys = {i: k for i in self.persistent if (k := _key(tensors[i])) is not None}
        out_leaves = list(self._out_leaves)
        for pos, t in zip(self._out_tensor_pos, flat_out):
            out_leaves[pos] = t
        self._ref = ref = weakref.ref(self)
        for k in self._storage_keys:
            _OWNERS[k] = ref
        weakref.finalize(self, _drop_owners, list(self._storage_keys), ref)
        self._state = "live"
        if mgr is not None:
            mgr.add_checkpoint(self)
        return tree_unflatten(out_leaves, self._out_spec)

    def _unflatten_args(self, tensors: Sequence[torch.Tensor]):
        leaves = list(self._leaves)
        for pos, t in zip(self._tensor_pos, tensors):
            leaves[pos] = t
        return tree_unflatten(leaves, self._in_spec)

    def _run_forward(self, ctx, tensors):
        self._ctx_ref = weakref.ref(ctx)
        args, kwargs = self._unflatten_args(tensors)
        before = _get_rng(self._devices) if self.preserve_rng_state else None
        out = self._fn(*args, **kwargs)
        if before is not None:
            self._rng = _consumed(before, _get_rng(self._devices))
        leaves, spec = tree_flatten(out)
        pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not pos:
            raise RecomputeError(f"checkpoint {self.name!r}: the function returned no tensor")
        in_keys = {k: i for i, t in enumerate(tensors) if (k := _key(t)) is not None}
        storages, metas = [], []
        index_of: dict[int, int] = {}
        for j, p in enumerate(pos):
            t = leaves[p]
            s = _storage(t)
            if s is None:
                raise RecomputeError(f"checkpoint {self.name!r}: output {j} has no plain storage ({t.layout})")
            k = s._cdata
            if k in in_keys:
                raise RecomputeError(
                    f"checkpoint {self.name!r}: output {j} shares storage with input {in_keys[k]} (a view of it "
                    "or the input itself); discarding the output would free that input. Return a copy "
                    "(e.g. .clone()) or do not checkpoint this function.")
            if t.requires_grad:  # under no_grad only a parameter (or a view of one) requires grad
                raise RecomputeError(
                    f"checkpoint {self.name!r}: output {j} is a tensor that requires grad (a parameter returned "
                    "as is?); discarding it would free it. Do not checkpoint this function.")
            if k in _OWNERS and _owner_of(t) is not None:
                raise RecomputeError(
                    f"checkpoint {self.name!r}: output {j} shares storage with the output of checkpoint "
                    f"{_owner_of(t).name!r}; return a copy.")
            if k not in index_of:
                index_of[k] = len(storages)
                storages.append(s)
            metas.append(_OutMeta(index_of[k], t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                                  t.dtype, t.device))
        self._storages = storages
        self._storage_nbytes = [s.nbytes() for s in storages]
        self._output_nbytes = sum(self._storage_nbytes)
        self._storage_keys = set(index_of)
        self._out_meta = metas
        self._out_leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self._out_tensor_pos, self._out_spec = pos, spec
        return tuple(leaves[p] for p in pos)

    # ---------------------------------------------------------------- discard / refill
    @property
    def outputs(self) -> tuple[torch.Tensor, ...]:
        """The output tensors still alive (weak references), in output order."""
        return tuple(t for r in self._out_refs if (t := r()) is not None)

    @property
    def output_nbytes(self) -> int:
        """Bytes of the output storages when filled (what `discard_output` frees)."""
        return self._output_nbytes

    @property
    def is_discarded(self) -> bool:
        return self._discarded

    def discard_output(self) -> None:
        """Free the output storages (`untyped_storage().resize_(0)`); tensor metadata stays."""
        if self._state != "live":
            return
        for s in self._storages:
            if s.nbytes():
                try:
                    s.resize_(0)
                except RuntimeError as e:
                    raise RecomputeError(f"checkpoint {self.name!r}: cannot free an output storage: {e}") from e
        self._discarded = self._ever_discarded = True

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Standalone use: free the outputs and recompute them when backward reaches
        `hook_tensor`. A no-op for a checkpoint registered with a manager (the manager discards
        and registers the unified hook)."""
        if self.manager is not None or self._state != "live":
            return
        if _key(hook_tensor) in self._storage_keys:
            raise RecomputeError(f"checkpoint {self.name!r}: the hook tensor is one of its own outputs")
        self.discard_output()
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(lambda grad: self.recompute())

    def recompute(self) -> None:
        """Re-run the function from its saved inputs with the forward's RNG and autocast state,
        under enable_grad, and refill the original output storages in place."""
        if self._state != "live" or self._recomputed is not None:
            return
        ctx = self._ctx_ref() if self._ctx_ref is not None else None
        if ctx is not None:
            inputs = ctx.saved_tensors  # autograd checks versions (in-place changes) and freed graphs
        elif self._held_inputs is not None:
            inputs = self._held_inputs
        else:
            raise RecomputeError(f"checkpoint {self.name!r}: its autograd graph was already freed")
        for i, t in enumerate(inputs):
            s = _storage(t)
            if s is not None and t.numel() and s.nbytes() == 0:
                owner = _owner_of(t)
                raise RecomputeError(
                    f"checkpoint {self.name!r}: input {i} is still discarded at recompute time"
                    + (f" (output of checkpoint {owner.name!r}, not recomputed before it)" if owner else ""))
        detached = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        args, kwargs = self._unflatten_args(detached)
        with _recompute_scope(), _rng_restored(self._rng), _autocast_as(self._autocast), torch.enable_grad():
            out = self._fn(*args, **kwargs)
        outs = [leaf for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]
        if len(outs) != len(self._out_meta) or any(
                tuple(o.shape) != m.size or o.dtype != m.dtype for o, m in zip(outs, self._out_meta)):
            raise RecomputeError(f"checkpoint {self.name!r}: the recomputed outputs differ in number, shape "
                                 "or dtype from the forward ones")
        if self._discarded:
            with torch.no_grad():
                for s, nbytes in zip(self._storages, self._storage_nbytes):
                    if s.nbytes() != nbytes:
                        s.resize_(nbytes)
                for m, o in zip(self._out_meta, outs):
                    dst = torch.empty(0, dtype=m.dtype, device=m.device)
                    dst.set_(self._storages[m.storage_index], m.offset, m.size, m.stride)
                    dst.copy_(o)  # a separate TensorImpl: the original's version counter is untouched
            self._discarded = False
        self._recomputed = (detached, outs)
        self.recompute_count += 1

    # ---------------------------------------------------------------- backward
    def _backward(self, ctx, grads):
        if self._recomputed is None:
            if self._discarded:
                mgr = self.manager
                raise RecomputeError(
                    f"checkpoint {self.name!r}: backward reached it while its outputs were discarded and not "
                    "recomputed: its recompute hook"
                    + (f" (manager {mgr.name!r})" if mgr is not None else "")
                    + " had not fired. A consumer of its outputs is reached by a path that does not go "
                    "through the hook tensor, or the hook tensor is not on the path to the loss.")
            self.recompute()  # never discarded: lazy recompute, the outputs are intact
        detached, outs = self._recomputed
        self._recomputed = None
        roots = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if roots:
            torch.autograd.backward([o for o, _ in roots], [g for _, g in roots])
        result = tuple(d.grad if d.requires_grad else None for d in detached)
        self._release()
        return result

    def _release(self) -> None:
        """After backward: drop the references to the (refilled) output storages, so they live
        only as long as the tensors that use them, as in plain autograd. Every consumer of the
        outputs has run its backward by now; a later backward (retain_graph=True) recomputes to
        rebuild the graph and finds the values intact."""
        _drop_owners(self._storage_keys, self._ref)
        self._storages, self._storage_nbytes, self._storage_keys = [], [], set()
        self._discarded = False

    def held_storages(self) -> list[torch.UntypedStorage]:
        """Storages this checkpoint keeps alive outside autograd's saved tensors: its outputs'
        (empty while discarded) and its RNG snapshots."""
        rng = self._rng.tensors() if self._rng is not None else []
        return list(self._storages) + [t.untyped_storage() for t in rng]

    def __repr__(self) -> str:
        mgr = self.manager
        return (f"CheckpointWithoutOutput({self.name!r}, manager={mgr.name if mgr else None!r}, "
                f"group={self.group_index}, refillable={self.refillable}, discarded={self._discarded})")


def _drop_owners(keys, ref: weakref.ref) -> None:
    for k in keys:
        _drop_owner(k, ref)


def _check_not_discarded(ckpt: CheckpointWithoutOutput, tensors: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        s = _storage(t)
        if s is None or t.numel() == 0 or s.nbytes() > 0:
            continue
        owner = _owner_of(t)
        where = ""
        if owner is not None:
            om = owner.manager
            where = (f": it is the output of checkpoint {owner.name!r}"
                     + (f" of manager {om.name!r} (group {owner.group_index})" if om is not None else
                        " (standalone)")
                     + ", already discarded")
        raise RecomputeError(
            f"checkpoint {ckpt.name!r}: input {i} has a discarded (empty) storage{where}. A checkpoint input "
            "must be persistent (produced by no checkpoint) or the output of an earlier checkpoint of the same "
            "recompute group; leave the op that produces a block or layer boundary un-checkpointed.")


def checkpoint_without_output(run_function: Callable, /, *args, **kwargs):
    """`CheckpointWithoutOutput().checkpoint(run_function, *args, **kwargs)`: registers with the
    current manager (the innermost `with BlockRecomputeManager()`), if any."""
    return CheckpointWithoutOutput().checkpoint(run_function, *args, **kwargs)


# --------------------------------------------------------------------------------------------
# the manager
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class HookRecord:
    """One registered unified hook: its group, the checkpoints it recomputes (forward order), a
    weak reference to the tensor it sits on (dead once only autograd holds that tensor), its shape
    and the name of its grad_fn. `handle` is None when the tensor did not require grad."""

    group_index: int
    checkpoint_names: list[str]
    tensor_ref: weakref.ref | None
    handle: Any
    shape: tuple[int, ...] = ()
    grad_fn_name: str | None = None   # the op that produced the hook tensor, e.g. "AddBackward0"

    @property
    def tensor(self) -> torch.Tensor | None:
        return self.tensor_ref() if self.tensor_ref is not None else None


class BlockRecomputeManager:
    """Collects the checkpoints of one block and recomputes them from one hook per group.

    `config`: a `RecomputeConfig` or a granularity string ("block" | "layer").
    Use it as a context manager around the block's forward; inside, call `end_layer(t)` after
    each layer and `finalize(t)` with the block's final tensor (an un-checkpointed tail)."""

    def __init__(self, config: RecomputeConfig | str = "block", *, name: str = "block"):
        cfg = config if isinstance(config, RecomputeConfig) else RecomputeConfig(granularity=config)
        if cfg.granularity not in GRANULARITIES:
            raise ValueError(f"a manager needs granularity 'block' or 'layer', got {cfg.granularity!r}; "
                             "for no recompute use no manager")
        self.config = cfg
        self.name = name
        self.checkpoints: list[CheckpointWithoutOutput] = []   # forward order, all groups
        self.groups: list[list[CheckpointWithoutOutput]] = []  # closed groups
        self.hooks: list[HookRecord] = []
        self.layer_boundaries: list[int] = []  # len(self.checkpoints) at each end_layer
        self.recompute_log: list[str] = []     # names, in the order recomputed
        self._open: list[CheckpointWithoutOutput] = []
        self._finalized = False
        self._entered = 0

    @property
    def granularity(self) -> str:
        return self.config.granularity

    # ---------------------------------------------------------------- context manager
    def __enter__(self) -> "BlockRecomputeManager":
        if self._finalized:
            raise RecomputeError(f"manager {self.name!r} is already finalized; use one manager per block forward")
        _stack().append(self)
        self._entered += 1
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        stack = _stack()
        if stack and stack[-1] is self:
            stack.pop()
        self._entered -= 1
        if exc_type is None and self._open:
            raise RecomputeError(
                f"manager {self.name!r}: the block ended with {len(self._open)} checkpoint(s) not finalized "
                f"({[c.name for c in self._open][:4]}...): call manager.finalize(block_output) before leaving "
                "the `with` block, so the outputs are discarded and the unified hook registered.")

    # ---------------------------------------------------------------- registration
    def checkpoint(self, name: str, run_function: Callable, /, *args, **kwargs):
        """Checkpoint `run_function(*args, **kwargs)` in this manager under `name`."""
        return CheckpointWithoutOutput(self, name=name).checkpoint(run_function, *args, **kwargs)

    def _admit(self, ckpt: CheckpointWithoutOutput, fn: Callable) -> None:
        if self._finalized:
            raise RecomputeError(f"manager {self.name!r} is finalized; checkpoint {ckpt.name!r} cannot join it")
        if ckpt.name is None:
            ckpt.name = f"{getattr(fn, '__name__', 'checkpoint')}#{len(self.checkpoints)}"
        ckpt._manager_ref = weakref.ref(self)
        ckpt.group_index = len(self.groups)

    def _classify_inputs(self, ckpt: CheckpointWithoutOutput, tensors: Sequence[torch.Tensor]) -> None:
        """Sort the tensor inputs into refillable / persistent; refuse the rest (seed 000)."""
        _check_not_discarded(ckpt, tensors)
        open_ids = {id(c) for c in self._open}
        for i, t in enumerate(tensors):
            owner = _owner_of(t)
            if owner is None:
                ckpt.persistent.append(i)
            elif id(owner) in open_ids:
                ckpt.refillable[i] = owner.name
            else:
                om = owner.manager
                if om is None:
                    why = "a standalone checkpoint (registered with no manager)"
                elif om is self:
                    why = (f"a checkpoint of the earlier layer group {owner.group_index} of this manager, whose "
                           "outputs are discarded at that layer's end")
                else:
                    why = f"a checkpoint of a different block manager {om.name!r}"
                raise RecomputeError(
                    f"checkpoint {ckpt.name!r} (manager {self.name!r}): input {i} is the output of checkpoint "
                    f"{owner.name!r}, {why}. Its recompute is not ordered before this group's, so it cannot be a "
                    "refillable input; produce it inside this group, or leave the producing op un-checkpointed "
                    "so the tensor is persistent.")

    def add_checkpoint(self, ckpt: CheckpointWithoutOutput) -> None:
        """Register a checkpoint that already ran (called by `CheckpointWithoutOutput.checkpoint`)."""
        if ckpt.manager is not self:
            raise RecomputeError(f"checkpoint {ckpt.name!r} was not created for manager {self.name!r}")
        self.checkpoints.append(ckpt)
        self._open.append(ckpt)

    # ---------------------------------------------------------------- boundaries
    def end_layer(self, layer_output: torch.Tensor) -> torch.Tensor:
        """Mark the end of a layer. granularity "layer": discard this layer's checkpoint outputs
        and hook `layer_output` (which must be un-checkpointed). "block": only recorded."""
        self.layer_boundaries.append(len(self.checkpoints))
        if self.granularity == "layer":
            self._close_group(layer_output)
        return layer_output

    def finalize(self, block_output: torch.Tensor) -> torch.Tensor:
        """End of the block: discard the open group's outputs and register the unified hook on
        `block_output` (un-checkpointed, e.g. the last bias-dropout-add output)."""
        if self._finalized:
            raise RecomputeError(f"manager {self.name!r} is already finalized")
        self._close_group(block_output)
        self._finalized = True
        return block_output

    # the name used in design v2.4
    discard_all_outputs_and_register_unified_recompute = finalize

    def _close_group(self, hook_tensor: torch.Tensor) -> None:
        group = self._open
        if not group:
            return
        if not isinstance(hook_tensor, torch.Tensor):
            raise TypeError(f"manager {self.name!r}: the hook tensor must be a tensor, got {type(hook_tensor)}")
        out_keys = set().union(*(c._storage_keys for c in group))
        hk = _key(hook_tensor)
        if hk in out_keys:
            owner = _owner_of(hook_tensor)
            raise RecomputeError(
                f"manager {self.name!r}: the hook tensor is the output of checkpoint "
                f"{owner.name if owner else '?'!r} of this group, which would be discarded. Leave the group's last "
                "op (e.g. the last bias-dropout-add) un-checkpointed and pass its output.")
        for c in group:  # persistent inputs are never discarded (holds by construction; cheap to check)
            for i, k in c._persistent_keys.items():
                if k in out_keys:
                    raise RecomputeError(f"checkpoint {c.name!r}: persistent input {i} would be discarded")
        self._check_reachable(group, hook_tensor)
        gi = len(self.groups)
        for c in group:
            c.discard_output()
        handle = None
        if hook_tensor.requires_grad:
            handle = hook_tensor.register_hook(self._make_hook(gi))
        try:
            tref = weakref.ref(hook_tensor)
        except TypeError:
            tref = None
        self.groups.append(group)
        gf = hook_tensor.grad_fn
        self.hooks.append(HookRecord(gi, [c.name for c in group], tref, handle, tuple(hook_tensor.shape),
                                     type(gf).__name__ if gf is not None else None))
        self._open = []

    def _check_reachable(self, group: list[CheckpointWithoutOutput], hook_tensor: torch.Tensor) -> None:
        """Every checkpoint node of the group must be upstream of the hook tensor."""
        targets: dict[int, CheckpointWithoutOutput] = {}
        for c in group:
            ctx = c._ctx_ref() if c._ctx_ref is not None else None
            if ctx is not None and c._has_node:
                targets[id(ctx)] = c
        if not targets:
            return
        min_seq = min(c._ctx_ref()._sequence_nr() for c in targets.values())
        root = hook_tensor.grad_fn
        seen: dict[int, Any] = {}
        stack = [root] if root is not None else []
        while stack and targets:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node  # keeps the wrapper alive, so ids are not reused
            targets.pop(id(node), None)
            for nxt, _ in node.next_functions:
                if nxt is not None and id(nxt) not in seen and nxt._sequence_nr() >= min_seq:
                    stack.append(nxt)
        if targets:
            names = [c.name for c in targets.values()]
            raise RecomputeError(
                f"manager {self.name!r}: checkpoint(s) {names} are not upstream of the hook tensor"
                + ("" if hook_tensor.requires_grad else " (it does not require grad)")
                + ". Their outputs would be discarded but backward could reach them, or their consumers, "
                "without passing the unified hook. Pass the group's final tensor.")

    def _make_hook(self, gi: int) -> Callable:
        def unified_recompute_hook(grad):
            self.recompute_group(gi)
            return None
        return unified_recompute_hook

    def recompute_group(self, gi: int) -> None:
        """Recompute the checkpoints of group `gi` in forward order (what the hook runs)."""
        for c in self.groups[gi]:
            if c._recomputed is None:
                c.recompute()
                self.recompute_log.append(c.name)

    # ---------------------------------------------------------------- reporting
    def held_storages(self) -> list[torch.UntypedStorage]:
        """Storages the checkpoints keep outside autograd's saved tensors (outputs, RNG)."""
        return [s for c in self.checkpoints for s in c.held_storages()]

    def stats(self) -> dict[str, Any]:
        return {
            "checkpoints": len(self.checkpoints),
            "groups": len(self.groups),
            "hooks": sum(h.handle is not None for h in self.hooks),
            "discarded_bytes": sum(c.output_nbytes for c in self.checkpoints if c._ever_discarded),
            "rng_snapshots": sum(c._rng is not None for c in self.checkpoints),
            "rng_bytes": sum(t.nbytes for c in self.checkpoints if c._rng for t in c._rng.tensors()),
        }

    def __repr__(self) -> str:
        return (f"BlockRecomputeManager({self.name!r}, granularity={self.granularity!r}, "
                f"checkpoints={len(self.checkpoints)}, groups={len(self.groups)}, finalized={self._finalized})")
