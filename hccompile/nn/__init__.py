"""Reference modules written in plain PyTorch, as users write them; the passes find their
patterns without knowing these classes."""
from .delta_net import (GatedDeltaNet, KimiDeltaAttention, TinyDeltaNetModel, plain_chunk_gated_delta_rule,
                        plain_chunk_kda, plain_recurrent_delta_rule)
from .htree import HTreeAttention, htree_attention_plain
from .lightning import LightningAttention, TinyLightningTransformer
from .linear_attention import PlainCausalLinearAttention, TinyLinearTransformer
from .mhc import HyperConnection, MHCGPT, MHCMapping

__all__ = ["GatedDeltaNet", "KimiDeltaAttention", "TinyDeltaNetModel", "plain_chunk_gated_delta_rule",
           "plain_chunk_kda", "plain_recurrent_delta_rule", "HTreeAttention", "htree_attention_plain",
           "LightningAttention", "TinyLightningTransformer", "PlainCausalLinearAttention", "TinyLinearTransformer", "HyperConnection", "MHCGPT",
           "MHCMapping"]
