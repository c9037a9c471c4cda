"""htree attention (seed 003): tree of mean-pooled K/V, top-down shared-GQA top-k refinement.

`reference.py` is the vectorised, differentiable PyTorch reference the Triton kernels are checked
against; `transcription.py` is a slow loop-by-loop transcription of the seed, used only as a test
oracle for the reference. The module docstring of `reference.py` lists the decisions taken on the
points the seed leaves open (RoPE pairing, ragged tails, sort modes, the causal variant).
"""

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
    "htree_layer_sizes",
    "htree_selections",
    "packed_index_bits",
]
