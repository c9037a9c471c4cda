"""Custom ops (with fake and autograd) that the passes lower to. Importing this package registers
every op, which must happen at import time: on an Inductor/AOT cache hit no pass runs, yet the cached
code still calls `torch.ops.hccompile.*`."""
from . import delta_rule  # noqa: F401  (registers torch.ops.hccompile.chunk_delta_rule*)
from . import lightning  # noqa: F401  (registers torch.ops.hccompile.lightning_attn*)
from . import linear_attn  # noqa: F401  (registers torch.ops.hccompile.causal_linear_attn*)
from . import htree  # noqa: F401  (registers torch.ops.hccompile.htree_attention*)
from . import mhc  # noqa: F401  (registers torch.ops.hccompile.mhc_*)
from .delta_rule import chunk_delta_rule, chunk_gated_delta_rule, chunk_kda
from .htree import htree_attention
from .lightning import lightning_attn
from .linear_attn import causal_linear_attn

__all__ = ["causal_linear_attn", "chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda",
           "htree_attention", "lightning_attn"]
