"""The forms this pass recognises as the rest of hccompile sees them: the pattern name each gets in
the report, the op each lowers to and what those ops accept. One small module at the bottom of the
package, so that the candidate (which knows its own form), the shape check and the pass read the
same names and the same table, and the choice of kernel per form stays in one place that the
integrator (and the tests) can change."""
from __future__ import annotations

import torch

from ..fx_match import Refusal


# Report pattern names, one per recognised form.
PATTERN = "causal_linear_attn"              # quadratic, no decay (the original name)
PATTERN_DECAY = "decayed_linear_attn"       # quadratic with a per-head decay
PATTERN_LOOP = "block_loop_linear_attn"     # lightning-attention-2 style block loop
PATTERN_CUMSUM = "cumulative_linear_attn"   # cumsum of k⊗v contracted with q

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


# ---------------------------------------------------------------------------------------------
# Which op each form lowers to. `causal_linear_attn` is the quadratic-tile kernel without decay;
# `lightning_attn` is the chunked kernel with a per-head decay (decay 0 when the form has none).
# Decay forms can only go to lightning_attn. The integrator sets the no-decay entries after the
# GPU benchmarks.
OP_FOR_FORM: dict[str, str] = {
    "quadratic": "lightning_attn",
    "quadratic_decay": "lightning_attn",
    "block_loop": "lightning_attn",
    "block_loop_decay": "lightning_attn",
    "cumulative": "lightning_attn",
}
_OPS = ("causal_linear_attn", "lightning_attn")


def lowering_op(form: str, has_decay: bool) -> str:
    """The op a recognised form is rewritten to (see OP_FOR_FORM)."""
    key = f"{form}_decay" if has_decay else form
    if key not in OP_FOR_FORM:
        raise ValueError(f"form {key!r} has no entry in OP_FOR_FORM ({sorted(OP_FOR_FORM)})")
    op = OP_FOR_FORM[key]
    if op not in _OPS:
        raise ValueError(f"OP_FOR_FORM[{key!r}] = {op!r}: must be one of {_OPS}")
    if has_decay and op != "lightning_attn":
        raise ValueError(f"OP_FOR_FORM[{key!r}] = {op!r}: only lightning_attn takes a decay")
    return op


class _NotThisPattern(Refusal):
    """Not even a candidate: nothing to report."""
