"""htree attention (seed 003): tree of mean-pooled K/V, top-down shared-GQA top-k refinement.

`reference.py` is the vectorised, differentiable PyTorch reference the Triton kernels are checked
against; `transcription.py` is a slow loop-by-loop transcription of the seed, used only as a test
oracle for the reference. The module docstring of `reference.py` lists the decisions taken on the
points the seed leaves open (RoPE pairing, ragged tails, sort modes, the causal variant).
`forward.py` and `backward.py` are the Triton kernels (shared tile helpers and the launch plan in
`tiles.py`); docs/htree.md describes them.
"""

from .backward import htree_backward
from .forward import htree_forward, selections_from_record
from .reference import (
    SORT_MODES,
    HTreeConfig,
    HTreeLayerSelection,
    htree_attention_ref,
    htree_layer_sizes,
    htree_selections,
    packed_index_bits,
)

__all__ = [
    "SORT_MODES",
    "HTreeConfig",
    "HTreeLayerSelection",
    "htree_attention_ref",
    "htree_backward",
    "htree_forward",
    "htree_layer_sizes",
    "htree_selections",
    "packed_index_bits",
    "selections_from_record",
]
