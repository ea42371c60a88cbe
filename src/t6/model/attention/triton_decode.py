"""Triton decode kernels for CUDA: the GPU implementations of `t6::tpa_decode` and
`t6::latent_decode` (see fused_decode.py for the arithmetic).

FlashTPA-style split-K: the cached sequence is split across programs (grid = batch x splits);
each program streams its share in blocks of BLOCK_S tokens with an online softmax over all
heads at once and writes a partial (max, denominator, numerator); the partials are combined
afterwards (`combine`). The cache may be fp32, bf16 or fp16, loaded and accumulated in fp32 (the
operands of tl.dot take Triton's default fp32 input precision, TF32 on tensor cores); batch >= 1;
an optional bool key mask [B, S] hides padding. The compile-time constants are the model's shapes
only, never the context length or the number of splits, and the integer arguments that follow the
context length are excluded from Triton's specialization, so one compiled kernel serves a whole
generation. Correctness is tested on the CPU through Triton's interpreter (TRITON_INTERPRET=1)
against the eager reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Integer arguments that change with the context length. Triton otherwise compiles a variant of a kernel
# for each value class of an integer argument (1, a multiple of 16, other), so a growing S compiles again.
CONTEXT_ARGS = ["S", "s_mask_b"]


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


@triton.jit(do_not_specialize=CONTEXT_ARGS)
def _tpa_kernel(
    qa_ptr,
    qb_ptr,
    ak_ptr,
    bk_ptr,
    av_ptr,
    bv_ptr,
    mask_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    S,
    H,
    D,
    per_split,
    s_ak_b,
    s_ak_s,
    s_bk_b,
    s_bk_s,
    s_av_b,
    s_av_s,
    s_bv_b,
    s_bv_s,
    s_mask_b,
    RQ: tl.constexpr,
    RK: tl.constexpr,
    RV: tl.constexpr,
    FACTORED: tl.constexpr,
    MASKED: tl.constexpr,
    HP: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    heads = tl.arange(0, HP)  # [HP]
    dims = tl.arange(0, DP)  # [DP]
    toks = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    h_ok = heads < H
    d_ok = dims < D
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, DP], tl.float32)
    s_lo = split * per_split
    s_hi = tl.minimum(s_lo + per_split, S)
    for s0 in range(s_lo, s_hi, BLOCK_S):
        s = s0 + toks  # [BLOCK_S]
        s_ok = s < s_hi
        scores = tl.zeros([BLOCK_S, HP], tl.float32)
        for r in tl.static_range(RK):
            bk = tl.load(
                bk_ptr + b * s_bk_b + s[:, None] * s_bk_s + r * D + dims[None, :],
                mask=s_ok[:, None] & d_ok[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_S, DP]
            ak = tl.load(
                ak_ptr + b * s_ak_b + s[:, None] * s_ak_s + r * H + heads[None, :],
                mask=s_ok[:, None] & h_ok[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_S, HP]
            if FACTORED:
                qb = tl.zeros([BLOCK_S, HP], tl.float32)
                for rq in tl.static_range(RQ):
                    q_row = tl.load(qb_ptr + (b * RQ + rq) * D + dims, mask=d_ok, other=0.0).to(tl.float32)  # [DP]
                    g = tl.sum(bk * q_row[None, :], axis=1)  # B_K[s, r] . B_Q[rq]: [BLOCK_S]
                    qa_row = tl.load(qa_ptr + (b * RQ + rq) * H + heads, mask=h_ok, other=0.0).to(tl.float32)  # [HP]
                    qb += g[:, None] * qa_row[None, :]  # [BLOCK_S, HP]
            else:
                q = tl.load(
                    qb_ptr + b * H * D + heads[:, None] * D + dims[None, :],
                    mask=h_ok[:, None] & d_ok[None, :],
                    other=0.0,
                ).to(tl.float32)  # [HP, DP]
                qb = tl.dot(bk, tl.trans(q))  # B_K[s, r] . q_i: [BLOCK_S, HP]
            scores += ak * qb
        visible = s_ok
        if MASKED:
            visible = visible & (tl.load(mask_ptr + b * s_mask_b + s, mask=s_ok, other=0) != 0)
        scores = tl.where(visible[:, None], scores, float("-inf"))  # [BLOCK_S, HP]
        m_new = tl.maximum(m, tl.max(scores, axis=0))  # [HP]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[None, :])  # [BLOCK_S, HP]
        corr = tl.exp(m - m_safe)  # [HP]
        l = l * corr + tl.sum(p, axis=0)
        acc = acc * corr[:, None]
        for r in tl.static_range(RV):
            av = tl.load(
                av_ptr + b * s_av_b + s[:, None] * s_av_s + r * H + heads[None, :],
                mask=s_ok[:, None] & h_ok[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_S, HP]
            bv = tl.load(
                bv_ptr + b * s_bv_b + s[:, None] * s_bv_s + r * D + dims[None, :],
                mask=s_ok[:, None] & d_ok[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_S, DP]
            acc += tl.dot(tl.trans(p * av), bv)  # sum_s P[s, i] A_V[s, r, i] B_V[s, r]: [HP, DP]
        m = m_new
    out = b * tl.num_programs(1) + split  # this program's partial: [B, splits] row-major
    tl.store(m_ptr + out * HP + heads, m)
    tl.store(l_ptr + out * HP + heads, l)
    tl.store(acc_ptr + out * HP * DP + heads[:, None] * DP + dims[None, :], acc)


@triton.jit(do_not_specialize=CONTEXT_ARGS)
def _latent_kernel(
    ql_ptr,
    qr_ptr,
    c_ptr,
    kr_ptr,
    mask_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    S,
    H,
    DC,
    DR,
    per_split,
    s_c_b,
    s_c_s,
    s_kr_b,
    s_kr_s,
    s_mask_b,
    MASKED: tl.constexpr,
    HP: tl.constexpr,
    DCP: tl.constexpr,
    DRP: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    heads = tl.arange(0, HP)
    cdims = tl.arange(0, DCP)
    rdims = tl.arange(0, DRP)
    toks = tl.arange(0, BLOCK_S)
    h_ok = heads < H
    q_lat = tl.load(
        ql_ptr + b * H * DC + heads[:, None] * DC + cdims[None, :],
        mask=h_ok[:, None] & (cdims[None, :] < DC),
        other=0.0,
    ).to(tl.float32)  # [HP, DCP]
    q_rope = tl.load(
        qr_ptr + b * H * DR + heads[:, None] * DR + rdims[None, :],
        mask=h_ok[:, None] & (rdims[None, :] < DR),
        other=0.0,
    ).to(tl.float32)  # [HP, DRP]
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, DCP], tl.float32)
    s_lo = split * per_split
    s_hi = tl.minimum(s_lo + per_split, S)
    for s0 in range(s_lo, s_hi, BLOCK_S):
        s = s0 + toks
        s_ok = s < s_hi
        c = tl.load(
            c_ptr + b * s_c_b + s[:, None] * s_c_s + cdims[None, :],
            mask=s_ok[:, None] & (cdims[None, :] < DC),
            other=0.0,
        ).to(tl.float32)  # [BLOCK_S, DCP]
        kr = tl.load(
            kr_ptr + b * s_kr_b + s[:, None] * s_kr_s + rdims[None, :],
            mask=s_ok[:, None] & (rdims[None, :] < DR),
            other=0.0,
        ).to(tl.float32)  # [BLOCK_S, DRP]
        scores = tl.dot(c, tl.trans(q_lat)) + tl.dot(kr, tl.trans(q_rope))  # [BLOCK_S, HP]
        visible = s_ok
        if MASKED:
            visible = visible & (tl.load(mask_ptr + b * s_mask_b + s, mask=s_ok, other=0) != 0)
        scores = tl.where(visible[:, None], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[None, :])  # [BLOCK_S, HP]
        corr = tl.exp(m - m_safe)
        l = l * corr + tl.sum(p, axis=0)
        acc = acc * corr[:, None] + tl.dot(tl.trans(p), c)  # [HP, DCP]
        m = m_new
    out = b * tl.num_programs(1) + split  # this program's partial: [B, splits] row-major
    tl.store(m_ptr + out * HP + heads, m)
    tl.store(l_ptr + out * HP + heads, l)
    tl.store(acc_ptr + out * HP * DCP + heads[:, None] * DCP + cdims[None, :], acc)


def combine(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Partials of the splits, m, l [B, splits, HP] and acc [B, splits, HP, W] -> [B, HP, W]."""
    top = m.amax(dim=1, keepdim=True)  # [B, 1, HP]
    scale = torch.where(
        m == float("-inf"), 0.0, torch.exp(m - torch.where(top == float("-inf"), 0.0, top))
    )  # [B, splits, HP]
    return (acc * scale[..., None]).sum(1) / (l * scale).sum(1)[..., None]  # [B, HP, W]


def _splits(B: int, S: int, block: int, dev: torch.device) -> int:
    """Enough programs to fill the device at batch 1; at least one block of tokens each."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    return max(1, min(triton.cdiv(S, block), triton.cdiv(2 * sms, B)))


def _mask_args(key_mask, device):
    if key_mask is None:
        return torch.empty(1, dtype=torch.int8, device=device), 0, False
    mask = key_mask.to(torch.int8)  # [B, S]
    return mask, mask.stride(0), True


def _partials(B: int, S: int, HP: int, width: int, block_s: int, dev):
    """The split of the cached sequence across programs and each program's partial softmax state:
    (tokens per program, programs, running max m [B, splits, HP], sum l [B, splits, HP],
    accumulator acc [B, splits, HP, width]), all fp32."""
    splits = _splits(B, S, block_s, dev)
    per = triton.cdiv(triton.cdiv(S, splits), block_s) * block_s  # whole blocks per program
    splits = triton.cdiv(S, per)
    m = torch.empty(B, splits, HP, dtype=torch.float32, device=dev)
    l = torch.empty(B, splits, HP, dtype=torch.float32, device=dev)
    acc = torch.empty(B, splits, HP, width, dtype=torch.float32, device=dev)
    return per, splits, m, l, acc


def tpa_decode(q_a, q_b, a_k, b_k, a_v, b_v, key_mask, block_s: int = 32) -> torch.Tensor:
    """Same arguments and result as t6::tpa_decode: [B, h, d_h]."""
    B, S, R_K, H = a_k.shape
    D, R_V = b_k.shape[-1], a_v.shape[2]
    for name, t in (("a_k", a_k), ("b_k", b_k), ("a_v", a_v), ("b_v", b_v)):
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"{name} must be a cache view whose per-token [R, n] block is contiguous")
    HP, DP = _pow2(H), _pow2(D)
    dev = q_b.device
    per, splits, m, l, acc = _partials(B, S, HP, DP, block_s, dev)
    mask, mask_stride, masked = _mask_args(key_mask, dev)
    factored = q_a is not None
    qa = q_a.contiguous() if factored else q_b  # unused when not factored
    _tpa_kernel[(B, splits)](
        qa,
        q_b.contiguous(),
        a_k,
        b_k,
        a_v,
        b_v,
        mask,
        m,
        l,
        acc,
        S,
        H,
        D,
        per,
        a_k.stride(0),
        a_k.stride(1),
        b_k.stride(0),
        b_k.stride(1),
        a_v.stride(0),
        a_v.stride(1),
        b_v.stride(0),
        b_v.stride(1),
        mask_stride,
        RQ=q_a.shape[1] if factored else 1,
        RK=R_K,
        RV=R_V,
        FACTORED=factored,
        MASKED=masked,
        HP=HP,
        DP=DP,
        BLOCK_S=block_s,
    )
    return (combine(m, l, acc)[:, :H, :D] / R_V).to(q_b.dtype)  # [B, h, d_h]


def latent_decode(q_lat, q_rope, c_kv, k_rope, key_mask, block_s: int = 32) -> torch.Tensor:
    """Same arguments and result as t6::latent_decode: [B, h, d_c]."""
    B, H, DC = q_lat.shape
    S, DR = c_kv.shape[1], k_rope.shape[-1]
    if c_kv.stride(-1) != 1 or k_rope.stride(-1) != 1:
        raise ValueError("c_kv and k_rope must be contiguous per token")
    HP, DCP, DRP = _pow2(H), _pow2(DC), _pow2(DR)
    dev = q_lat.device
    per, splits, m, l, acc = _partials(B, S, HP, DCP, block_s, dev)
    mask, mask_stride, masked = _mask_args(key_mask, dev)
    _latent_kernel[(B, splits)](
        q_lat.contiguous(),
        q_rope.contiguous(),
        c_kv,
        k_rope,
        mask,
        m,
        l,
        acc,
        S,
        H,
        DC,
        DR,
        per,
        c_kv.stride(0),
        c_kv.stride(1),
        k_rope.stride(0),
        k_rope.stride(1),
        mask_stride,
        MASKED=masked,
        HP=HP,
        DCP=DCP,
        DRP=DRP,
        BLOCK_S=block_s,
    )
    return combine(m, l, acc)[:, :H, :DC].to(q_lat.dtype)  # [B, h, d_c]
