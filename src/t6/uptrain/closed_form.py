"""Closed-form starts for a converted attention, from a grouped-query source (MHA, GQA, MQA: every
pretrained Llama): each writes the target layer's weights from the source layer's, and from the
statistics of the layer's input on calibration text (t6.uptrain.distill.input_statistics) where the
target needs them. `CLOSED_FORMS` names them by target class; a mechanism without one starts from its
own initialization, and layer-wise distillation (t6.uptrain.distill) takes it from there.

- GQA / MQA / MHA: the source's KV heads pooled into G groups (mean, or each group's first; GQA paper
  §2.1), or repeated when G is a multiple of them. Exact when G repeats them.
- MLA (MHA2MLA, arXiv 2502.14837; TransMLA, arXiv 2502.07864): partial RoPE, then a joint low-rank
  factorization of the keys' no-RoPE part and the values.
  * RoPE: T6's MLA rotates rope_dim dimensions of one key shared by all heads, at the frequencies of a
    rope_dim-wide table, which are every (head_dim / rope_dim)-th frequency of the source's head: those
    pairs stay rotated (MHA2MLA's uniform choice), the shared key is the mean of the KV heads' (MQA's
    pooling, since T6's MLA caches one rope key rather than one per head), and the other dimensions of
    every query and key lose their rotation (nope_dim = head_dim - rope_dim, so the scale is the source's).
  * Keys and values: the rows of every KV head's no-RoPE key and value projections, stacked, factorized
    to rank kv_lora_rank by an SVD whitened by the input's covariance (the factorization that is best on
    the calibration inputs, not on the weights): the latent c = R x is the cache, the up projection L
    gives each query head its KV head's keys and values. Whitening makes E[c c^T] = I, so the latent's
    RMSNorm (kv_norm, weight 1) is the identity on average, exact only per token up to its RMS.
  * Queries: exact. The block's attention norm x = g * n (n of unit RMS) is undone by q_down = 1/g
    (q_lora_rank = d_model), so MLA's query norm sees n, already normalized, and q_up = W_Q diag(g).
- TPA, TPA-KVonly (arXiv 2501.06425): each of K, V as R rank-one terms A(x)^T B(x). B_r is the source's
  KV head r (the heads pooled into R groups when fewer), which RoPE rotates as T6's TPA rotates B_K; A
  should select each query head's group, a constant, but A is linear in x: it is the least-squares linear
  map to that constant on the calibration inputs (E[x]^T E[x x^T]^-1), as good as the input has a steady
  component. The query: exact for TPA-KVonly (W_Q); TPA's factors the same way with q_rank = n_head
  (B_r = query head r), else its own initialization.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from t6.errors import SettingError
from t6.model.attention.gqa import GroupedQueryAttention
from t6.model.attention.mla import MultiHeadLatentAttention
from t6.model.attention.tpa import TensorProductAttention

Stats = tuple[torch.Tensor, torch.Tensor]  # (E[x] [d], E[x x^T] [d, d]) of a layer's attention input, fp64
POOLING = ("mean", "first")


def heads(weight: torch.Tensor, n: int) -> torch.Tensor:
    """A projection [n * d_h, d_model] -> its n heads [n, d_h, d_model]."""
    return weight.view(n, weight.shape[0] // n, weight.shape[1])


def pool_heads(weight: torch.Tensor, n_head: int, groups: int, method: str = "mean") -> torch.Tensor:
    """A K or V projection of n_head heads [n_head * d_h, d_model] -> [groups * d_h, d_model]: contiguous heads
    pooled into each group (mean, or its first head), or each head repeated when groups is a multiple."""
    if method not in POOLING:
        raise SettingError(f"method={method!r}: choose one of {list(POOLING)}")
    rows, d_model = weight.shape
    if groups % n_head == 0:  # more KV heads than the source has: each repeated (exact)
        return heads(weight, n_head).repeat_interleave(groups // n_head, dim=0).reshape(-1, d_model)
    if n_head % groups:
        raise SettingError(
            f"target_kv_heads={groups} neither divides nor is a multiple of the source's {n_head} KV heads"
        )
    grouped = weight.view(groups, n_head // groups, rows // n_head, d_model)  # [G, h/G, d_h, d_model]
    pooled = grouped.mean(dim=1) if method == "mean" else grouped[:, 0]  # [G, d_h, d_model]
    return pooled.reshape(groups * (rows // n_head), d_model)  # [G * d_h, d_model]


def group_of(n: int, groups: int) -> torch.Tensor:
    """Which of `groups` contiguous groups each of n items belongs to [n] (groups need not divide n)."""
    return torch.arange(n) * groups // n


def pooled(weight: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """n heads [n * d_h, d_model] pooled (mean) into `groups` contiguous groups -> [groups, d_h, d_model]."""
    w, owner = heads(weight, n), group_of(n, groups)
    return torch.stack([w[owner == g].mean(0) for g in range(groups)])


@torch.no_grad()
def gqa_from_gqa(src: GroupedQueryAttention, dst: GroupedQueryAttention, stats, norm, method: str = "mean") -> None:
    dst.q.weight.copy_(src.q.weight)
    dst.out.weight.copy_(src.out.weight)
    dst.k.weight.copy_(pool_heads(src.k.weight, src.n_kv, dst.n_kv, method))
    dst.v.weight.copy_(pool_heads(src.v.weight, src.n_kv, dst.n_kv, method))


def whitening(second: torch.Tensor, rel_floor: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, S^-1) with S S = E[n n^T] (symmetric square root, eigenvalues floored at rel_floor x the largest)."""
    vals, vecs = torch.linalg.eigh(second)  # [d], [d, d]
    vals = vals.clamp_min(vals.max() * rel_floor)
    return (vecs * vals.sqrt()) @ vecs.T, (vecs * vals.rsqrt()) @ vecs.T


def rope_subset(head_dim: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope dims, no-RoPE dims) of a source head: the pairs rotated at the frequencies of a rope_dim-wide
    table (every head_dim/rope_dim-th pair), in Rotary's [first halves | second halves] order."""
    if rope_dim <= 0 or head_dim % rope_dim:
        raise SettingError(
            f"attention.options.rope_dim={rope_dim} must divide size.head_dim={head_dim} for the closed form "
            "(its frequencies are then a subset of the source's)"
        )
    half, stride = head_dim // 2, head_dim // rope_dim
    kept = torch.arange(0, half, stride)  # [rope_dim / 2] pairs
    rope = torch.cat([kept, kept + half])  # [rope_dim]
    nope = torch.tensor([i for i in range(head_dim) if i not in set(rope.tolist())], dtype=torch.long)
    return rope, nope


def safe_inverse(g: torch.Tensor, floor: float = 1e-6) -> torch.Tensor:
    """1 / g, with entries of |g| < floor taken as +-floor (a norm weight of zero has no inverse)."""
    return 1.0 / torch.where(g.abs() < floor, torch.where(g < 0, -floor, floor), g)


@torch.no_grad()
def mla_from_gqa(src: GroupedQueryAttention, dst: MultiHeadLatentAttention, stats: Stats, norm: torch.Tensor) -> None:
    h, d_h, n_kv = src.cfg.n_head, src.cfg.head_dim, src.n_kv
    d_model = src.cfg.d_model
    if dst.d_nope + dst.d_rope != d_h or dst.d_v != d_h:
        raise SettingError(
            f"the MLA closed form needs attention.options.nope_dim = size.head_dim - rope_dim = {d_h - dst.d_rope} "
            f"and v_dim = {d_h} (the source's head widths)"
        )
    if dst.d_cq != d_model:
        raise SettingError(f"the MLA closed form needs attention.options.q_lora_rank = size.d_model = {d_model}")
    rope, nope = rope_subset(d_h, dst.d_rope)
    g = norm.double()  # the attention norm's weight [d]: x = g * n
    g_inv = safe_inverse(g)
    wq, wk, wv = (heads(w.double(), n) for w, n in ((src.q.weight, h), (src.k.weight, n_kv), (src.v.weight, n_kv)))
    # queries: exact
    dst.q_down.weight.copy_(torch.diag(g_inv))  # [d, d]: x -> n
    dst.q_norm.weight.fill_(1.0)
    q = torch.cat([wq[:, nope], wq[:, rope]], dim=1) * g  # [h, nope+rope, d]: acting on n
    dst.q_up.weight.copy_(q.reshape(-1, d_model))
    # keys and values: whitened joint SVD of the no-RoPE keys and the values of every KV head, in n's coordinates
    joint = torch.cat([wk[:, nope], wv], dim=1) * g  # [n_kv, nope + d_h, d]
    stacked = joint.reshape(-1, d_model)  # [n_kv (nope + d_h), d]
    _, second = stats
    sqrt, inv_sqrt = whitening(g_inv[:, None] * second * g_inv[None, :])  # E[n n^T]^(1/2), ^(-1/2)
    u, s, vt = torch.linalg.svd(stacked @ sqrt, full_matrices=False)
    r = dst.d_c
    if r > s.numel():
        raise SettingError(
            f"attention.options.kv_lora_rank={r} exceeds the rank of the source's keys and values ({s.numel()})"
        )
    left = (u[:, :r] * s[:r]).view(n_kv, -1, r)  # [n_kv, nope + d_h, r]
    right = vt[:r] @ inv_sqrt  # [r, d]: c = right n, with E[c c^T] = I
    owner = torch.arange(h) // (h // n_kv)  # each query head's KV head
    dst.kv_up.weight.copy_(left[owner].reshape(-1, r))  # [h (nope + d_v), r]
    rope_key = wk[:, rope].mean(0)  # [rope, d]: one key shared by all heads (the KV heads' mean), on x itself
    dst.kv_down.weight.copy_(torch.cat([right * g_inv, rope_key]))  # [r + rope, d]
    dst.kv_norm.weight.fill_(1.0)
    dst.out.weight.copy_(src.out.weight)


def constant_fit(target: torch.Tensor, stats: Stats, ridge: float = 1e-6) -> torch.Tensor:
    """The linear map W [k, d] whose output W x is closest to the constant target [k] over the calibration
    inputs: argmin E||W x - t||^2 = t E[x]^T E[x x^T]^-1."""
    mean, second = stats
    reg = second + ridge * second.diagonal().mean() * torch.eye(second.shape[0], dtype=second.dtype)
    return target.double()[:, None] * torch.linalg.solve(reg, mean)[None, :]  # [k, d]


@torch.no_grad()
def fit_factor(factor, weight: torch.Tensor, n: int, stats: Stats) -> None:
    """One TPA factor pair from n heads [n * d_h, d_model] of the source: B_r the heads pooled into R groups,
    A fitted to select each head's group (R on its group, 0 elsewhere; the contraction divides by R)."""
    R, h = factor.rank, factor.n_head
    factor.b.weight.copy_(pooled(weight.double(), n, R).reshape(-1, weight.shape[1]))  # [R d_h, d]
    head_group = group_of(n, R)[torch.arange(h) * n // h]  # [h]: the group of each query head's source head
    target = (torch.arange(R)[:, None] == head_group[None, :]).double() * R  # [R, h]
    factor.a.weight.copy_(constant_fit(target.reshape(-1), stats))  # [R h, d]


@torch.no_grad()
def tpa_from_gqa(src: GroupedQueryAttention, dst: TensorProductAttention, stats: Stats, norm: torch.Tensor) -> None:
    h = src.cfg.n_head
    if dst.kv_only:
        dst.q.weight.copy_(src.q.weight)
    elif dst.q.rank == h:
        fit_factor(dst.q, src.q.weight, h, stats)
    fit_factor(dst.k, src.k.weight, src.n_kv, stats)
    fit_factor(dst.v, src.v.weight, src.n_kv, stats)
    dst.out.weight.copy_(src.out.weight)


# target attention class -> its closed form from a grouped-query source layer:
# (source attention, target attention, input statistics, the block's attention-norm weight) -> None
CLOSED_FORMS: dict[type, Callable] = {
    GroupedQueryAttention: gqa_from_gqa,
    MultiHeadLatentAttention: mla_from_gqa,
    TensorProductAttention: tpa_from_gqa,
}


def closed_form(target_cls: type) -> Callable | None:
    """The closed form into an attention class (exactly that class: a variant's layers differ), or None."""
    return CLOSED_FORMS.get(target_cls)
