"""Triton decode kernels for CUDA: the GPU implementations of `t6::tpa_decode`, `t6::latent_decode` and
`t6::gqa_decode` (see fused_decode.py for the arithmetic).

Split-K over the cached sequence (as FlashDecoding): one program per (row, split) streams its share of
the row's tokens in blocks of BLOCK_S with an online softmax over all heads at once, and writes a partial
(max, denominator, numerator) into an fp32 workspace; a second small kernel (`_combine_kernel`) merges
a row's partials per head and writes the result in the query's dtype. Two launches per call, no other
work: no host reads, no allocation whose size depends on values, so a call can be captured in a CUDA
graph. The workspace is one allocation per call from PyTorch's caching allocator (no cudaMalloc once
warm), not a buffer kept across calls: under torch.compile's CUDA graphs, warm-up routes a thread's
allocations to the graph's memory pool, which hands out again whatever it does not know to be live.

The cache may be fp32, bf16 or fp16. The contractions over tokens and over the head width are tensor-core
dots whose operands stay in the cache's dtype (fp32 operands take Triton's default TF32 precision) with
fp32 accumulation; the softmax and the rescaling are fp32. TPA contracts its query factors once per
program into the full query [h, d_h] (A_Q^T B_Q), so a token's scores are R_K dots B_K[s, r] . q_i times
A_K[s, r, i]. The grouped kernel (`t6::gqa_decode`: MHA, GQA, MQA, GTA; and `t6::latent_decode`, MLA's latent
as one K/V head whose rows are keys and values, read once) runs one program per (row, K/V head, split): the
group's query heads are the rows of its dots, so each K/V head's cache is read once for all of them, and a batch
of one fills the GPU through its K/V heads times its splits. An optional bool key mask [B, S] hides padding;
optional lengths [B] bound each row: a row reads only its first lengths[b] cached tokens, so a caller may pass a
whole preallocated cache (a fixed shape) and the rows' lengths as a device tensor.

The compile-time constants are the model's shapes, the cache's dtype and the launch's `Tuning` (chosen by
shape class and dtype, `TUNING`), never the context length,
the number of splits or the lengths, and the integer arguments that follow the context length are
excluded from Triton's specialization, so one compiled kernel serves a whole generation. Correctness
is tested on the CPU through Triton's interpreter (TRITON_INTERPRET=1) against the eager reference for
every tuning the table holds; the tunings' speed is measured by `python -m t6.bench.decode_kernels`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

# Integer arguments that change with the context length. Triton otherwise compiles a variant of a kernel
# for each value class of an integer argument (1, a multiple of 16, other), so a growing S compiles again.
CONTEXT_ARGS = ["S", "s_mask_b"]
COMBINE_CONTEXT_ARGS = ["n_splits"]


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How a kernel is launched: BLOCK_S cached tokens per loop step, Triton's num_warps and num_stages
    (software pipelining of the loop's loads), and the split of the sequence: about `waves` programs per
    SM over the whole batch, each with at least `min_tokens` cached tokens (every program writes an fp32
    partial of HP x (W + 2) values, which the combine reads back: traffic beside the cache's)."""

    block_s: int
    num_warps: int
    num_stages: int
    waves: int
    min_tokens: int


# By the operator (the grouped kernel runs "gqa"'s and "latent"'s), its shape class (whether the fp32 accumulator
# [HP, W] holds more than 64 x 64 values: MLA's d_c = 256 and TPA at xl) and the cache's element size (fp32: 4
# bytes; bf16, fp16: 2). Each entry fits every
# shape of its class that a registered mechanism has at any size into an H100's 232,448 B of shared memory
# without spilling registers, in sm_90 code compiled ahead of time (tests/test_triton_decode.py compiles each
# for sm_90 with Triton's own ptxas on a machine without a GPU). A tuning chosen by shape alone did not fit: the
# fp32 TPA kernel at small, medium and large needed 360,448 B, and 4 warps spilled registers in bf16. The latent
# form's narrow bf16 class runs 4 warps: GLA's latent heads in one grouped launch spilled 32-40 B with 8.
# Speed unmeasured on a GPU so far: `python -m t6.bench.decode_kernels --sweep` times the candidates on one.
TUNING = {
    ("gqa", False, 4): Tuning(block_s=64, num_warps=4, num_stages=3, waves=2, min_tokens=256),
    ("gqa", False, 2): Tuning(block_s=64, num_warps=4, num_stages=3, waves=2, min_tokens=256),
    ("gqa", True, 4): Tuning(block_s=32, num_warps=8, num_stages=2, waves=2, min_tokens=256),
    ("gqa", True, 2): Tuning(block_s=64, num_warps=8, num_stages=2, waves=2, min_tokens=256),
    ("tpa", False, 4): Tuning(block_s=32, num_warps=8, num_stages=2, waves=2, min_tokens=256),
    ("tpa", False, 2): Tuning(block_s=32, num_warps=8, num_stages=3, waves=2, min_tokens=256),
    ("tpa", True, 4): Tuning(block_s=16, num_warps=8, num_stages=2, waves=2, min_tokens=256),
    ("tpa", True, 2): Tuning(block_s=16, num_warps=8, num_stages=2, waves=2, min_tokens=256),
    ("latent", False, 4): Tuning(block_s=32, num_warps=8, num_stages=3, waves=2, min_tokens=256),
    ("latent", False, 2): Tuning(block_s=32, num_warps=4, num_stages=3, waves=2, min_tokens=256),
    ("latent", True, 4): Tuning(block_s=32, num_warps=8, num_stages=2, waves=2, min_tokens=256),
    ("latent", True, 2): Tuning(block_s=32, num_warps=8, num_stages=3, waves=2, min_tokens=256),
}
COMBINE_CHUNK = 16  # splits merged per step by _combine_kernel
SHARED_MEMORY_SM90 = 232_448  # bytes of shared memory a block may use on an H100 or H200


def tuning_for(kernel: str, HP: int, W: int, dtype: torch.dtype) -> Tuning:
    """The table's tuning for operator `kernel` ("tpa", "latent" or "gqa") with padded head count HP (the grouped
    kernel's: query heads per K/V head) and value width W, over a cache of `dtype` (fp32; bf16 or fp16)."""
    return TUNING[kernel, HP * W > 64 * 64, 4 if dtype.itemsize >= 4 else 2]


# Host arithmetic in plain Python: triton.cdiv and triton.next_power_of_2 are constexpr functions whose
# call costs microseconds, per call of the operators.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, least: int = 16) -> int:
    """The next power of two >= n, at least `least` (tl.arange and tl.dot extents)."""
    return max(least, 1 << (n - 1).bit_length())


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; off CUDA (Triton's interpreter) 4, so tests see splits."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def splits(rows: int, S: int, tuning: Tuning, device: torch.device) -> int:
    """Programs per row (a batch row, or the grouped kernel's (batch row, K/V head)): about `waves` per SM over
    the rows, at least `min_tokens` (and one block) each."""
    per_program = max(tuning.min_tokens, tuning.block_s)
    return max(1, min(S // per_program, _cdiv(tuning.waves * _sm_count(device), rows)))


@triton.jit
def _split_range(len_ptr, b, S, LENGTHS: tl.constexpr, BLOCK_S: tl.constexpr):
    """This program's share [s_lo, s_hi) of row b's valid tokens, in whole blocks."""
    n = S
    if LENGTHS:
        n = tl.minimum(tl.load(len_ptr + b).to(tl.int32), S)  # the row's valid tokens
    per = tl.cdiv(tl.cdiv(n, tl.num_programs(1)), BLOCK_S) * BLOCK_S
    s_lo = tl.program_id(1) * per
    return s_lo, tl.minimum(s_lo + per, n)


@triton.jit
def _store_partial(ws_ptr, m, l, acc, H, HP: tl.constexpr, W: tl.constexpr):
    """Writes this program's (m [HP], l [HP], acc [HP, W]) into the workspace: m of every program, then
    every l, then every acc, programs in [B, splits] row-major order; the H real heads only (the padding
    heads' rows are traffic the combine never reads)."""
    programs = tl.num_programs(0) * tl.num_programs(1)
    out = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    heads = tl.arange(0, HP)
    cols = tl.arange(0, W)
    h_ok = heads < H
    tl.store(ws_ptr + out * HP + heads, m, mask=h_ok)
    tl.store(ws_ptr + (programs + out) * HP + heads, l, mask=h_ok)
    tl.store(ws_ptr + 2 * programs * HP + out * HP * W + heads[:, None] * W + cols[None, :], acc, mask=h_ok[:, None])


@triton.jit
def _online_softmax(scores, m, l, acc):
    """One block's scores [BLOCK_S, HP] (-inf where hidden) into the running (m, l, acc): returns the
    probabilities P [BLOCK_S, HP] relative to the new max, the new m and l, and acc rescaled to it."""
    m_new = tl.maximum(m, tl.max(scores, axis=0))  # [HP]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head that has seen nothing yet
    p = tl.exp(scores - m_safe[None, :])  # [BLOCK_S, HP]
    corr = tl.exp(m - m_safe)  # [HP]
    return p, m_new, l * corr + tl.sum(p, axis=0), acc * corr[:, None]


@triton.jit(do_not_specialize=CONTEXT_ARGS)
def _tpa_kernel(
    qa_ptr,
    qb_ptr,
    ak_ptr,
    bk_ptr,
    av_ptr,
    bv_ptr,
    mask_ptr,
    len_ptr,
    ws_ptr,
    S,
    H,
    D,
    s_qa_b,
    s_qb_b,
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
    LENGTHS: tl.constexpr,
    HP: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HP)  # [HP]
    dims = tl.arange(0, DP)  # [DP]
    toks = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    h_ok = heads < H
    d_ok = dims < D
    if FACTORED:  # the full query q_i = sum_r' A_Q[r', i] B_Q[r'], contracted once: [HP, DP]
        q = tl.zeros([HP, DP], tl.float32)
        for rq in tl.static_range(RQ):
            qa_row = tl.load(qa_ptr + b * s_qa_b + rq * H + heads, mask=h_ok, other=0.0).to(tl.float32)  # [HP]
            qb_row = tl.load(qb_ptr + b * s_qb_b + rq * D + dims, mask=d_ok, other=0.0).to(tl.float32)  # [DP]
            q += qa_row[:, None] * qb_row[None, :]  # [HP, DP]
    else:
        q = tl.load(
            qb_ptr + b * s_qb_b + heads[:, None] * D + dims[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0
        )  # [HP, DP]
    q = q.to(bk_ptr.dtype.element_ty)  # a dot operand in the cache's dtype
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, DP], tl.float32)
    s_lo, s_hi = _split_range(len_ptr, b, S, LENGTHS, BLOCK_S)
    for s0 in range(s_lo, s_hi, BLOCK_S):
        s = s0 + toks  # [BLOCK_S]
        s_ok = s < s_hi
        scores = tl.zeros([BLOCK_S, HP], tl.float32)
        for r in tl.static_range(RK):
            bk = tl.load(
                bk_ptr + b * s_bk_b + s[:, None] * s_bk_s + r * D + dims[None, :],
                mask=s_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [BLOCK_S, DP]
            ak = tl.load(
                ak_ptr + b * s_ak_b + s[:, None] * s_ak_s + r * H + heads[None, :],
                mask=s_ok[:, None] & h_ok[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_S, HP]
            scores += ak * tl.dot(bk, tl.trans(q))  # A_K[s, r, i] (B_K[s, r] . q_i): [BLOCK_S, HP]
        visible = s_ok
        if MASKED:
            visible = visible & (tl.load(mask_ptr + b * s_mask_b + s, mask=s_ok, other=0) != 0)
        scores = tl.where(visible[:, None], scores, float("-inf"))  # [BLOCK_S, HP]
        p, m, l, acc = _online_softmax(scores, m, l, acc)
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
            )  # [BLOCK_S, DP]
            w = (p * av).to(bv.dtype)  # P[s, i] A_V[s, r, i]: [BLOCK_S, HP]
            acc += tl.dot(tl.trans(w), bv)  # sum_s P[s, i] A_V[s, r, i] B_V[s, r]: [HP, DP]
    _store_partial(ws_ptr, m, l, acc, H, HP, DP)


@triton.jit
def _group_rows(ptr, first, heads, h_ok, W, dims, d_ok):
    """A group's query rows first + heads [GP] of a [h, W] block, zero past the group and the width: [GP, WP]."""
    return tl.load(ptr + (first + heads[:, None]) * W + dims[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit(do_not_specialize=CONTEXT_ARGS)
def _gqa_kernel(
    q_ptr,
    qr_ptr,
    k_ptr,
    v_ptr,
    kr_ptr,
    mask_ptr,
    len_ptr,
    ws_ptr,
    S,
    H_KV,
    G,
    DK,
    DV,
    DR,
    s_q_b,
    s_qr_b,
    s_k_b,
    s_k_h,
    s_k_s,
    s_v_b,
    s_v_h,
    s_v_s,
    s_kr_b,
    s_kr_s,
    s_mask_b,
    ROPE: tl.constexpr,
    SHARED: tl.constexpr,
    MASKED: tl.constexpr,
    LENGTHS: tl.constexpr,
    GP: tl.constexpr,
    DKP: tl.constexpr,
    DVP: tl.constexpr,
    DRP: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program (row, split) of the grid (B x H_KV, splits): batch row b = row // H_KV, K/V head j = row % H_KV,
    its G query heads j G .. j G + G - 1 against its share of the row's cached tokens. SHARED: the values are
    the keys' rows, loaded once (the latent form: MLA's latent, GLA's latent heads)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // H_KV
    j = row % H_KV
    heads = tl.arange(0, GP)  # [GP]: the group's query heads
    kdims = tl.arange(0, DKP)  # [DKP]
    vdims = tl.arange(0, DVP)  # [DVP]
    toks = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    h_ok = heads < G
    k_ok = kdims < DK
    v_ok = vdims < DV
    q = _group_rows(q_ptr + b * s_q_b, j * G, heads, h_ok, DK, kdims, k_ok).to(k_ptr.dtype.element_ty)  # [GP, DKP]
    if ROPE:
        rdims = tl.arange(0, DRP)  # [DRP]
        r_ok = rdims < DR
        q_rope = _group_rows(qr_ptr + b * s_qr_b, j * G, heads, h_ok, DR, rdims, r_ok)  # [GP, DRP]
        q_rope = q_rope.to(kr_ptr.dtype.element_ty)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DVP], tl.float32)
    s_lo, s_hi = _split_range(len_ptr, b, S, LENGTHS, BLOCK_S)
    for s0 in range(s_lo, s_hi, BLOCK_S):
        s = s0 + toks  # [BLOCK_S]
        s_ok = s < s_hi
        k = tl.load(
            k_ptr + b * s_k_b + j * s_k_h + s[:, None] * s_k_s + kdims[None, :],
            mask=s_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_S, DKP]
        scores = tl.dot(k, tl.trans(q))  # k[s] . q_i: [BLOCK_S, GP]
        if ROPE:
            kr = tl.load(
                kr_ptr + b * s_kr_b + s[:, None] * s_kr_s + rdims[None, :],
                mask=s_ok[:, None] & r_ok[None, :],
                other=0.0,
            )  # [BLOCK_S, DRP]
            scores += tl.dot(kr, tl.trans(q_rope))  # + k_rope[s] . q_rope_i: [BLOCK_S, GP]
        visible = s_ok
        if MASKED:
            visible = visible & (tl.load(mask_ptr + b * s_mask_b + s, mask=s_ok, other=0) != 0)
        scores = tl.where(visible[:, None], scores, float("-inf"))  # [BLOCK_S, GP]
        p, m, l, acc = _online_softmax(scores, m, l, acc)
        if SHARED:
            v = k  # [BLOCK_S, DVP] (DVP = DKP)
        else:
            v = tl.load(
                v_ptr + b * s_v_b + j * s_v_h + s[:, None] * s_v_s + vdims[None, :],
                mask=s_ok[:, None] & v_ok[None, :],
                other=0.0,
            )  # [BLOCK_S, DVP]
        acc += tl.dot(tl.trans(p.to(v.dtype)), v)  # sum_s P[s, i] v[s]: [GP, DVP]
    _store_partial(ws_ptr, m, l, acc, G, GP, DVP)


@triton.jit(do_not_specialize=COMBINE_CONTEXT_ARGS)
def _combine_kernel(
    ws_ptr,
    out_ptr,
    n_splits,
    W,
    scale,
    s_out_b,
    s_out_h,
    HP: tl.constexpr,
    WP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Row b, head i (grid B x h): out[b, i] = scale sum_j e^(m_j - M) acc_j[i] / sum_j e^(m_j - M) l_j[i]
    over the row's splits j, M = max_j m_j."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    programs = tl.num_programs(0) * n_splits
    chunk = tl.arange(0, CHUNK)  # [CHUNK]
    cols = tl.arange(0, WP)  # [WP]
    top = tl.full([CHUNK], float("-inf"), tl.float32)
    for j0 in range(0, n_splits, CHUNK):
        j = b * n_splits + j0 + chunk  # [CHUNK]: the splits' program numbers
        top = tl.maximum(top, tl.load(ws_ptr + j * HP + i, mask=j0 + chunk < n_splits, other=float("-inf")))
    big = tl.max(top, axis=0)
    big = tl.where(big == float("-inf"), 0.0, big)
    den = tl.zeros([CHUNK], tl.float32)
    num = tl.zeros([WP], tl.float32)
    for j0 in range(0, n_splits, CHUNK):
        j = b * n_splits + j0 + chunk  # [CHUNK]
        j_ok = j0 + chunk < n_splits
        m = tl.load(ws_ptr + j * HP + i, mask=j_ok, other=float("-inf"))  # [CHUNK]
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - big))  # [CHUNK]: each split's weight
        den += w * tl.load(ws_ptr + (programs + j) * HP + i, mask=j_ok, other=0.0)  # [CHUNK]
        part = tl.load(
            ws_ptr + 2 * programs * HP + (j[:, None] * HP + i) * WP + cols[None, :],
            mask=j_ok[:, None],
            other=0.0,
        )  # [CHUNK, WP]
        num += tl.sum(part * w[:, None], axis=0)  # [WP]
    y = num * (scale / tl.sum(den, axis=0))  # [WP]
    tl.store(out_ptr + b * s_out_b + i * s_out_h + cols, y.to(out_ptr.dtype.element_ty), mask=cols < W)


@dataclasses.dataclass
class Launch:
    """One call of an operator, planned: the decode kernel on a (rows, splits) grid with its arguments, compile-time
    constants and tuning, then the combine of its partials (the workspace ws) into out [B, h, W], seen as
    [rows, h / rows * B, W]: a row per batch row (TPA, the latent form) or per (batch row, K/V head) (the grouped
    kernel, whose row holds its group's heads). `run()` launches both; t6.bench.kernel_fit compiles the same kernels
    ahead of time from a plan."""

    kernel: object
    args: tuple
    constants: dict
    tuning: Tuning
    ws: torch.Tensor
    out: torch.Tensor
    splits: int
    HP: int
    WP: int
    scale: float
    rows: int | None = None  # None: the batch's rows

    def grid_rows(self) -> tuple[int, int]:
        """(programs along the grid's first axis, heads each combines)."""
        B, H, _ = self.out.shape
        rows = self.rows or B
        return rows, B * H // rows

    def combine_args(self) -> tuple:
        W = self.out.shape[2]
        out = self.out.view(*self.grid_rows(), W)  # [rows, heads per row, W]
        return (self.ws, out, self.splits, W, self.scale, out.stride(0), out.stride(1))

    def combine_constants(self) -> dict:
        return dict(HP=self.HP, WP=self.WP, CHUNK=COMBINE_CHUNK)

    def run(self) -> torch.Tensor:
        rows, heads = self.grid_rows()
        t = self.tuning
        self.kernel[rows, self.splits](*self.args, **self.constants, num_warps=t.num_warps, num_stages=t.num_stages)
        _combine_kernel[rows, heads](*self.combine_args(), **self.combine_constants())
        return self.out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A query [B, n, w] whose rows are each contiguous (any stride between rows), as the kernels read it."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def _mask_arg(key_mask: torch.Tensor | None, stand_in: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(pointer, row stride) of a bool key mask [B, S] read as bytes; without a mask, a pointer never read."""
    if key_mask is None:
        return stand_in, 0
    if key_mask.stride(-1) != 1:
        key_mask = key_mask.contiguous()
    return key_mask.view(torch.uint8), key_mask.stride(0)


def tpa_decode(q_a, q_b, a_k, b_k, a_v, b_v, key_mask, lengths=None, tuning: Tuning | None = None) -> torch.Tensor:
    """Same arguments and result as t6::tpa_decode: [B, h, d_h]. tuning: the table's by default."""
    return tpa_launch(q_a, q_b, a_k, b_k, a_v, b_v, key_mask, lengths, tuning).run()


def tpa_launch(q_a, q_b, a_k, b_k, a_v, b_v, key_mask, lengths=None, tuning: Tuning | None = None) -> Launch:
    """The launch `tpa_decode` makes, planned (its workspace and output allocated), not run."""
    B, S, R_K, H = a_k.shape
    D, R_V = b_k.shape[-1], a_v.shape[2]
    for name, t in (("a_k", a_k), ("b_k", b_k), ("a_v", a_v), ("b_v", b_v)):
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"{name} must be a cache view whose per-token [R, n] block is contiguous")
    HP, DP = _pow2(H), _pow2(D)
    tuning = tuning or tuning_for("tpa", HP, DP, b_k.dtype)
    n = splits(B, S, tuning, q_b.device)
    ws = q_b.new_empty(B * n * HP * (DP + 2), dtype=torch.float32)  # the partials (m, l, acc) of B x n programs
    mask, s_mask_b = _mask_arg(key_mask, q_b)
    factored = q_a is not None
    q_b = _rows(q_b)
    q_a = _rows(q_a) if factored else q_b  # not read without a factorized query
    args = (
        q_a,
        q_b,
        a_k,
        b_k,
        a_v,
        b_v,
        mask,
        q_b if lengths is None else lengths,
        ws,
        S,
        H,
        D,
        q_a.stride(0),
        q_b.stride(0),
        a_k.stride(0),
        a_k.stride(1),
        b_k.stride(0),
        b_k.stride(1),
        a_v.stride(0),
        a_v.stride(1),
        b_v.stride(0),
        b_v.stride(1),
        s_mask_b,
    )
    constants = dict(
        RQ=q_a.shape[1] if factored else 1,
        RK=R_K,
        RV=R_V,
        FACTORED=factored,
        MASKED=key_mask is not None,
        LENGTHS=lengths is not None,
        HP=HP,
        DP=DP,
        BLOCK_S=tuning.block_s,
    )
    out = q_b.new_empty(B, H, D)
    return Launch(_tpa_kernel, args, constants, tuning, ws, out, n, HP, DP, 1.0 / R_V)


def latent_decode(q_lat, q_rope, c_kv, k_rope, key_mask, lengths=None, tuning: Tuning | None = None) -> torch.Tensor:
    """Same arguments and result as t6::latent_decode: [B, h, d_c]. tuning: the table's by default."""
    return latent_launch(q_lat, q_rope, c_kv, k_rope, key_mask, lengths, tuning).run()


def latent_launch(q_lat, q_rope, c_kv, k_rope, key_mask, lengths=None, tuning: Tuning | None = None) -> Launch:
    """The launch `latent_decode` makes, planned: the grouped kernel with one K/V head, the latent, whose rows are
    the keys and the values (read once), the shared RoPE key its second score; the latent shapes' tunings."""
    if c_kv.stride(-1) != 1 or k_rope.stride(-1) != 1:
        raise ValueError("c_kv and k_rope must be contiguous per token")
    latent = c_kv[:, None]  # [B, 1, S, d_c]: one K/V head
    return gqa_launch(q_lat, latent, latent, q_rope, k_rope, key_mask, lengths, tuning)


def gqa_decode(q, k, v, q_rope, k_rope, key_mask, lengths=None, tuning: Tuning | None = None) -> torch.Tensor:
    """Same arguments and result as t6::gqa_decode: [B, h, d_v]. tuning: the table's by default."""
    return gqa_launch(q, k, v, q_rope, k_rope, key_mask, lengths, tuning).run()


def gqa_launch(q, k, v, q_rope, k_rope, key_mask, lengths=None, tuning: Tuning | None = None) -> Launch:
    """The launch `gqa_decode` makes, planned (its workspace and output allocated), not run. v the very tensor k
    (the latent form: GLA's latent heads, MLA's latent): the kernel loads each row once, for scores and values,
    with the latent shapes' tunings."""
    B, H, DK = q.shape
    H_KV, S, DV = k.shape[1], k.shape[2], v.shape[-1]
    G = H // H_KV
    rope = q_rope is not None
    shared = v is k
    DR = q_rope.shape[-1] if rope else 0
    for name, t in (("k", k), ("v", v), ("k_rope", k_rope)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be a cache view whose rows (one per token) are contiguous")
    GP, DKP, DVP, DRP = _pow2(G), _pow2(DK), _pow2(DV), _pow2(max(DR, 1))
    tuning = tuning or tuning_for("latent" if shared else "gqa", GP, DVP, k.dtype)
    n = splits(B * H_KV, S, tuning, q.device)
    ws = q.new_empty(B * H_KV * n * GP * (DVP + 2), dtype=torch.float32)  # the partials of B H_KV x n programs
    mask, s_mask_b = _mask_arg(key_mask, q)
    q = _rows(q)
    q_rope = _rows(q_rope) if rope else q  # not read without a shared RoPE part
    k_rope = k_rope if rope else k
    args = (
        q,
        q_rope,
        k,
        v,
        k_rope,
        mask,
        q if lengths is None else lengths,
        ws,
        S,
        H_KV,
        G,
        DK,
        DV,
        DR,
        q.stride(0),
        q_rope.stride(0),
        k.stride(0),
        k.stride(1) if H_KV > 1 else 0,  # one K/V head: never read (a view's may follow its length: a recompile)
        k.stride(2),
        v.stride(0),
        v.stride(1) if H_KV > 1 else 0,
        v.stride(2),
        k_rope.stride(0),
        k_rope.stride(-2),
        s_mask_b,
    )
    constants = dict(
        ROPE=rope,
        SHARED=shared,
        MASKED=key_mask is not None,
        LENGTHS=lengths is not None,
        GP=GP,
        DKP=DKP,
        DVP=DVP,
        DRP=DRP,
        BLOCK_S=tuning.block_s,
    )
    out = q.new_empty(B, H, DV)
    return Launch(_gqa_kernel, args, constants, tuning, ws, out, n, GP, DVP, 1.0, rows=B * H_KV)
