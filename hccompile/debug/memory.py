"""What a partitioned forward graph saves for backward, read off the graph itself."""
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
