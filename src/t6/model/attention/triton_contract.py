"""Triton kernels of `t6::tpa_contract` (t6.model.attention.factor_contract): TPA's contraction of Q, K or V from
their factors, forward and backward, one program per token, the head and feature axes padded to powers of two.

    forward    out[n, i, :] = s sum_r a[n, r, i] b[n, r, :]                    (s = 1/R)
    backward   da[n, r, i] = s sum_j g[n, i, j] b[n, r, j]
               db[n, r, :] = s sum_i g[n, i, :] a[n, r, i]

The forward reads each token's factors once and writes its [h, d_h] once; the backward reads each token's
gradient [h, d_h] once for both factors' gradients (inductor's generated code reads it once per factor: two
reductions over different axes). Accumulation in fp32, results in the inputs' dtype. Imported on the first CUDA
call (or under Triton's interpreter, TRITON_INTERPRET=1, on the CPU: how the tests run them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4  # a [64, 64] tile per program: 32 fp32 values per thread


@triton.jit
def contract_forward(
    a_ptr,
    b_ptr,
    out_ptr,
    stride_an,
    stride_ar,
    stride_bn,
    stride_br,
    H,
    D,
    scale,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask_h, mask_d = h < H, d < D
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for r in tl.static_range(R):
        a = tl.load(a_ptr + n * stride_an + r * stride_ar + h, mask=mask_h, other=0.0).to(tl.float32)  # [BLOCK_H]
        b = tl.load(b_ptr + n * stride_bn + r * stride_br + d, mask=mask_d, other=0.0).to(tl.float32)  # [BLOCK_D]
        acc += a[:, None] * b[None, :]
    out = out_ptr + n * H * D + h[:, None] * D + d[None, :]
    tl.store(out, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


@triton.jit
def contract_backward(
    g_ptr,
    a_ptr,
    b_ptr,
    da_ptr,
    db_ptr,
    stride_gn,
    stride_gh,
    stride_an,
    stride_ar,
    stride_bn,
    stride_br,
    H,
    D,
    scale,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask_h, mask_d = h < H, d < D
    g_tile = g_ptr + n * stride_gn + h[:, None] * stride_gh + d[None, :]
    g = tl.load(g_tile, mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    for r in tl.static_range(R):
        a = tl.load(a_ptr + n * stride_an + r * stride_ar + h, mask=mask_h, other=0.0).to(tl.float32)  # [BLOCK_H]
        b = tl.load(b_ptr + n * stride_bn + r * stride_br + d, mask=mask_d, other=0.0).to(tl.float32)  # [BLOCK_D]
        da = tl.sum(g * b[None, :], axis=1) * scale  # [BLOCK_H]
        db = tl.sum(g * a[:, None], axis=0) * scale  # [BLOCK_D]
        tl.store(da_ptr + (n * R + r) * H + h, da.to(da_ptr.dtype.element_ty), mask=mask_h)
        tl.store(db_ptr + (n * R + r) * D + d, db.to(db_ptr.dtype.element_ty), mask=mask_d)


def rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., m, k] as [N, m, k] with its last axis contiguous (a view where the strides allow)."""
    t = t.reshape(-1, *t.shape[-2:])  # [N, m, k]
    return t if t.stride(-1) == 1 else t.contiguous()


def blocks(h: int, d: int) -> dict:
    return {"BLOCK_H": triton.next_power_of_2(h), "BLOCK_D": triton.next_power_of_2(d)}


def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., R, h], b [..., R, d_h] -> (1/R) A^T B per token [..., h, d_h]."""
    lead, (R, h), d = a.shape[:-2], a.shape[-2:], b.shape[-1]
    a2, b2 = rows(a), rows(b)  # [N, R, h], [N, R, d_h]
    out = torch.empty(a2.shape[0], h, d, dtype=a.dtype, device=a.device)  # [N, h, d_h]
    if out.shape[0]:
        contract_forward[(out.shape[0],)](
            a2, b2, out, a2.stride(0), a2.stride(1), b2.stride(0), b2.stride(1), h, d, 1.0 / R,
            R=R, **blocks(h, d), num_warps=NUM_WARPS,
        )  # fmt: skip
    return out.view(*lead, h, d)


def backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `forward` at (a, b) for grad [..., h, d_h] -> (da [..., R, h], db [..., R, d_h])."""
    (R, h), d = a.shape[-2:], b.shape[-1]
    g2, a2, b2 = rows(grad), rows(a), rows(b)  # [N, h, d_h], [N, R, h], [N, R, d_h]
    da = torch.empty(a2.shape, dtype=a.dtype, device=a.device)  # [N, R, h]
    db = torch.empty(b2.shape, dtype=b.dtype, device=b.device)  # [N, R, d_h]
    if da.shape[0]:
        contract_backward[(da.shape[0],)](
            g2, a2, b2, da, db, g2.stride(0), g2.stride(1), a2.stride(0), a2.stride(1), b2.stride(0), b2.stride(1),
            h, d, 1.0 / R, R=R, **blocks(h, d), num_warps=NUM_WARPS,
        )  # fmt: skip
    return da.view(a.shape), db.view(b.shape)
