"""Plain-PyTorch references for the fused mHC kernels, in the kernels' canonical layouts.

Per token, x ∈ R^{n×C} (n streams), and per sublayer F:

    y      = Σ_i H_pre[i] · x[i]                                   (aggregate)
    x_next = A · x + H_post ⊗ f,   A = H_res or H_resᵀ              (post: apply_h_res + apply_h_post + add)

with the mappings from the projection p = v·φ of the flattened stream (one part of p per mapping,
at `spec.offsets`) and the per-token norm r:

    z      = coef · α · p · ρ + bias,  ρ = 1/r (or r when `spec.r_divides` is False)
    H_pre  = a_pre  · σ(z_pre)  + b_pre            (usually a = 1, b = 0 or ε)
    H_post = a_post · σ(z_post) + b_post           (usually a = 2, b = 0)
    H_res  = Sinkhorn-Knopp(z_res as n×n): m = exp(z) or softmax_row(z) + ε_init, then `steps`
             normalisations m / (m.sum(dim) + ε_norm), alternating rows and columns, rows first
             when `spec.row_first`.

Canonical layouts (the ops and the kernels use the same):
    x [T1, T2, n, C], h_res [T1, T2, n, n], h_pre / h_post [T1, T2, n], f / y [T1, T2, C];
    proj [..., n²+2n], r [...] or [..., 1], α 0-d or one-element, bias_pre/post [n], bias_res [n²].
These references compute in the dtype they are given (float64 in the tests); the ops' fallback
upcasts to at least float32 first.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

INITS = ("exp", "softmax")


@dataclasses.dataclass(frozen=True)
class MappingSpec:
    """What the mapping computes besides its tensors; see the module docstring for the formulas."""

    n: int
    offsets: tuple[int, int, int] | None = None   # start of the pre, post, res parts in proj
    coefs: tuple[float, float, float] = (1.0, 1.0, 1.0)
    r_divides: bool = True
    pre_affine: tuple[float, float] = (1.0, 0.0)   # H_pre = a·σ(z) + b
    post_affine: tuple[float, float] = (2.0, 0.0)
    init: str = "exp"
    init_eps: float = 0.0
    steps: int = 40                                 # normalisations (2 per Sinkhorn iteration)
    row_first: bool = True
    norm_eps: float = 0.0

    @property
    def width(self) -> int:
        return self.n * self.n + 2 * self.n

    def part_offsets(self) -> tuple[int, int, int]:
        return self.offsets if self.offsets is not None else (0, self.n, 2 * self.n)

    def validate(self) -> None:
        """Errors name the field and the limit."""
        from .mapping import MAX_SINKHORN_STEPS, MAX_STREAMS

        n = self.n
        if not isinstance(n, int) or not 1 <= n <= MAX_STREAMS:
            raise ValueError(f"n: the number of streams must be an int in [1, {MAX_STREAMS}], got {n!r}")
        if self.init not in INITS:
            raise ValueError(f"init: must be one of {INITS}, got {self.init!r}")
        if not isinstance(self.steps, int) or not 0 <= self.steps <= MAX_SINKHORN_STEPS:
            raise ValueError(f"steps: Sinkhorn normalisations must be an int in [0, "
                             f"{MAX_SINKHORN_STEPS}], got {self.steps!r}")
        pre, post, res = self.part_offsets()
        spans = sorted([(pre, n), (post, n), (res, n * n)])
        if spans[0][0] != 0 or any(a + la != b for (a, la), (b, _) in zip(spans, spans[1:])) or \
                spans[-1][0] + spans[-1][1] != self.width:
            raise ValueError(f"offsets: the pre ({n}), post ({n}) and res ({n * n}) parts must tile "
                             f"the projection's {self.width} columns, got offsets {self.part_offsets()}")
        for name in ("coefs", "pre_affine", "post_affine"):
            if not all(isinstance(v, (int, float)) for v in getattr(self, name)):
                raise ValueError(f"{name}: expected numbers, got {getattr(self, name)!r}")


def mhc_post_ref(x: Tensor, h_res: Tensor, h_post: Tensor, f: Tensor, transpose_res: bool = False
                 ) -> Tensor:
    """x_next[i] = Σ_j A[i, j] x[j] + H_post[i] f, A = H_resᵀ if `transpose_res` else H_res."""
    a = h_res.transpose(-1, -2) if transpose_res else h_res
    return a @ x + h_post.unsqueeze(-1) * f.unsqueeze(-2)


def mhc_post_bwd_ref(x: Tensor, h_res: Tensor, h_post: Tensor, f: Tensor, dout: Tensor,
                     transpose_res: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dh_res, dh_post, df) of mhc_post_ref, written out."""
    a = h_res.transpose(-1, -2) if transpose_res else h_res
    dx = a.transpose(-1, -2) @ dout
    da = dout @ x.transpose(-1, -2)
    dh_res = da.transpose(-1, -2) if transpose_res else da
    dh_post = (dout * f.unsqueeze(-2)).sum(-1)
    df = (h_post.unsqueeze(-1) * dout).sum(-2)
    return dx, dh_res, dh_post, df


def mhc_aggregate_ref(x: Tensor, h_pre: Tensor) -> Tensor:
    """y = Σ_i H_pre[i] x[i]."""
    return (h_pre.unsqueeze(-2) @ x).squeeze(-2)


def mhc_aggregate_bwd_ref(x: Tensor, h_pre: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """(dx, dh_pre) of mhc_aggregate_ref, written out."""
    return h_pre.unsqueeze(-1) * dy.unsqueeze(-2), (x * dy.unsqueeze(-2)).sum(-1)


def mhc_project_ref(v: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """(proj, sq): the projection v·wᵀ of the flattened stream v [..., K] by F.linear's weight w [W, K],
    and the sum of squares Σ_k v² that the per-token norm r is made from."""
    return v @ w.transpose(0, 1), (v * v).sum(-1)


def mhc_project_bwd_ref(v: Tensor, w: Tensor, dproj: Tensor, dsq: Tensor) -> tuple[Tensor, Tensor]:
    """(dv, dw) of mhc_project_ref, written out."""
    dv = dproj @ w + 2 * dsq.unsqueeze(-1) * v
    return dv, dproj.reshape(-1, dproj.shape[-1]).transpose(0, 1) @ v.reshape(-1, v.shape[-1])


def sinkhorn_ref(logits: Tensor, spec: MappingSpec) -> Tensor:
    """Sinkhorn-Knopp of [..., n, n] logits as `spec` says."""
    if spec.init == "exp":
        m = torch.exp(logits)
    else:
        m = torch.softmax(logits, dim=-1) + spec.init_eps
    for step in range(spec.steps):
        dim = -1 if (step % 2 == 0) == spec.row_first else -2
        m = m / (m.sum(dim, keepdim=True) + spec.norm_eps)
    return m


def mhc_mapping_ref(proj: Tensor, r: Tensor, alphas: tuple[Tensor, Tensor, Tensor],
                    biases: tuple[Tensor, Tensor, Tensor], spec: MappingSpec
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """(H_pre [..., n], H_post [..., n], H_res [..., n, n]) from proj [..., n²+2n] and r."""
    n = spec.n
    lead = proj.shape[:-1]
    r = r.reshape(*lead, 1)
    rho = 1.0 / r if spec.r_divides else r
    parts = []
    for off, width, coef, alpha, bias in zip(spec.part_offsets(), (n, n, n * n), spec.coefs,
                                             alphas, biases):
        p = proj[..., off:off + width]
        parts.append(coef * alpha.reshape(()) * p * rho + bias.reshape(width))
    z_pre, z_post, z_res = parts
    h_pre = spec.pre_affine[0] * torch.sigmoid(z_pre) + spec.pre_affine[1]
    h_post = spec.post_affine[0] * torch.sigmoid(z_post) + spec.post_affine[1]
    h_res = sinkhorn_ref(z_res.unflatten(-1, (n, n)), spec)
    return h_pre, h_post, h_res
