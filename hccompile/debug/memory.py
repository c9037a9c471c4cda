"""What is saved for backward: read off a partitioned forward graph (saved_activation_bytes), or seen
at run time by autograd's saved-tensor hooks (SavedStorages)."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..compat import size_hint


def _storage_key(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def saved_activation_bytes(fwd: fx.GraphModule, num_user_outputs: int) -> dict[str, Any]:
    """Bytes of the tensors AOTAutograd's forward graph returns for backward (outputs after the
    user outputs), counting each storage once and leaving out inputs and parameters (and views of
    them), which backward holds anyway. Symbolic sizes use their hints."""
    outs = fwd.graph.output_node().args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    inputs = set()
    for n in fwd.graph.nodes:
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor):
            try:
                inputs.add(_storage_key(n.meta["val"]))
            except Exception:  # noqa: BLE001 - storage of a fake may be unavailable; count it then
                pass
    seen, total, count, names = set(), 0, 0, []
    for n in outs[num_user_outputs:]:
        val = n.meta.get("val") if isinstance(n, fx.Node) else None
        if not isinstance(val, torch.Tensor) or n.op == "placeholder":
            continue
        try:
            key = _storage_key(val)
        except Exception:  # noqa: BLE001
            key = id(n)
        if key in inputs or key in seen:
            continue
        seen.add(key)
        # the whole storage stays alive, not just the view that is saved
        try:
            nbytes = size_hint(val.untyped_storage().nbytes())
        except Exception:  # noqa: BLE001 - fall back to the view's own size
            nbytes = val.element_size()
            for s in val.shape:
                nbytes *= size_hint(s)
        total += nbytes
        count += 1
        names.append(f"{n.name}:{tuple(size_hint(s) for s in val.shape)}:{str(val.dtype).replace('torch.', '')}")
    return {"bytes": total, "tensors": count, "names": names}


class SavedStorages:
    """What autograd saves for backward while this context is active, seen by saved_tensors_hooks:
    the distinct storages (a view and its base count once), less those of `exclude` (parameters,
    inputs: tensors or storages the caller holds anyway). `nbytes` reads their sizes when asked, so a
    storage freed in between (a discarded checkpoint output resized to 0) counts 0.

        with SavedStorages(exclude=model.parameters()) as saved:
            out = model(x)
        print(saved.nbytes)

    The pack hook returns a detached tensor: an identity hook makes a saved output and its grad_fn a
    cycle through C++ that gc cannot free when no backward runs (pytorch#189025; on the H100 it kept
    the demo's eager graphs, 19 GiB, alive into the next section). Backward through the saved
    tensors works as without the hooks. Drop the object when counted: it holds the storages."""

    def __init__(self, exclude: Any = ()):
        self._skip = {_storage_id(t) for t in exclude}
        self.storages: dict[int, torch.UntypedStorage] = {}
        self._hooks = None

    def add(self, storages: Any) -> None:
        """Counts these storages too (what a checkpoint keeps itself), each once, unless excluded."""
        for storage in storages:
            if storage._cdata not in self._skip:
                self.storages.setdefault(storage._cdata, storage)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add([t.untyped_storage()])
        return t.detach()

    def __enter__(self) -> "SavedStorages":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.storages.values())


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _storage_id(t: Any) -> int:
    """The identity of a tensor's (or a storage's) storage, as SavedStorages keys it."""
    return (t.untyped_storage() if isinstance(t, torch.Tensor) else t)._cdata
