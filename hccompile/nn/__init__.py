"""Reference modules written in plain PyTorch, as users write them; the passes find their
patterns without knowing these classes."""
from .lightning import LightningAttention, TinyLightningTransformer
from .linear_attention import PlainCausalLinearAttention, TinyLinearTransformer
from .mhc import HyperConnection, MHCGPT, MHCMapping

__all__ = ["LightningAttention", "TinyLightningTransformer", "PlainCausalLinearAttention", "TinyLinearTransformer", "HyperConnection", "MHCGPT",
           "MHCMapping"]
