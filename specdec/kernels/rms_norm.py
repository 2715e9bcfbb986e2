"""RMSNorm of each row on its own: y = x * rsqrt(mean(x^2) + eps) * w, in fp32, cast to the
output dtype.

    x    [..., D]  fp32 (the residual stream)
    w    [D]       fp32
    out  [..., D]  `out_dtype`

One program per row, the whole row in one block of next_power_of_2(D) elements: the sum of
squares of a row is reduced in the same order whatever the number of rows, so a row of a
verification forward is normalised to the bits of the decode step at its slot. Batch-
invariant forwards on the Triton backend use it (`specdec.models.batch_invariant`); a
library norm may choose its reduction by the tensor's shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.utils import launch, next_power_of_2, pick_backend

MAX_DIM = 1 << 16


@triton.jit
def _rms_norm_rows_kernel(X, W, OUT, D, eps, stride_x, stride_o, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=0) / D
    y = x * (1.0 / tl.sqrt(ms + eps)) * w
    tl.store(OUT + row * stride_o + offs, y.to(OUT.dtype.element_ty), mask=mask)


def rms_norm_rows_reference(
    x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """Plain torch, same formula, in float64 for tests."""
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return y.to(out_dtype)


def rms_norm_rows(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
    backend: str | None = None,
) -> torch.Tensor:
    """RMSNorm of x [..., D] with weight w [D] -> [..., D] in out_dtype, each row on its own
    (see the module docstring). backend: None follows resolve_backend; "torch" is F.rms_norm."""
    D = x.shape[-1]
    if w.shape != (D,):
        raise ValueError(f"rms_norm_rows: weight {tuple(w.shape)} does not match rows of {D}")
    if not 1 <= D <= MAX_DIM:
        raise ValueError(f"rms_norm_rows: rows of 1..{MAX_DIM} elements, got {D}")
    if pick_backend(backend, x.device) == "torch":
        return torch.nn.functional.rms_norm(x.float(), (D,), w.float(), eps).to(out_dtype)
    x2d = x.reshape(-1, D)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty(x2d.shape, dtype=out_dtype, device=x.device)
    if x2d.shape[0]:
        block = next_power_of_2(D)
        launch(
            _rms_norm_rows_kernel,
            (x2d.shape[0],),
            x2d,
            w.contiguous(),
            out,
            D,
            float(eps),
            x2d.stride(0),
            out.stride(0),
            BLOCK_D=block,
            num_warps=4 if block <= 2048 else 8,
        )
    return out.view(*x.shape[:-1], D)
