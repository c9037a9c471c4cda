"""hccompile: a torch.compile backend (`backend="hc"`) that recomputes mHC hyper-connections and
lowers plain-PyTorch attention subgraphs to Triton kernels."""
from . import compat as _compat

_compat.check_torch_version()
_compat.trace_through_einops()

from . import lowering  # noqa: E402  (registers torch.ops.hccompile.*)
from .debug import Report  # noqa: E402
from .explain import explain  # noqa: E402
from .lowering import (causal_linear_attn, chunk_delta_rule, chunk_gated_delta_rule,  # noqa: E402
                       chunk_kda, htree_attention, lightning_attn)
from .backend import hc_backend  # noqa: E402  (also reachable as backend="hc")
from . import distributed  # noqa: E402  (context parallelism)
from . import substitutes as _substitutes  # noqa: E402

_substitutes.install()  # library functions Dynamo would unroll, traced as our ops under hc

__version__ = "0.1.0"

__all__ = ["hc_backend", "explain", "Report", "causal_linear_attn", "chunk_delta_rule",
           "chunk_gated_delta_rule", "chunk_kda", "htree_attention", "lightning_attn", "__version__"]
