"""Tensor Product Attention (TPA, arXiv 2501.06425 §3) and TPA-KVonly.

Each token's query, key and value are sums of rank-one tensor products of a head factor
A(x_t) in R^{R x h} and a token-dimension factor B(x_t) in R^{R x d_h}, both linear in x_t:

    Q_t = (1/R_Q) A_Q(x_t)^T B_Q(x_t)   (same for K with R_K, V with R_V)      [h, d_h]

RoPE is applied to B_Q and B_K before the contraction (§3.2, Theorem 1), so keys are
cached pre-rotated. Defaults R_Q=6, R_K=R_V=2 (`TPAOptions`). `tpa_kvonly` is the preset
q_rank = None: a standard query projection, K and V factorized.

Cached per token and layer: A_K, B_K, A_V, B_V, that is (R_K + R_V)(h + d_h) numbers
(paper Table 1), for both `tpa` and `tpa_kvonly`.

Two ways to attend:
- materialized (training, prefill, long chunks): K and V are contracted to [S, h, d_h] and
  passed to SDPA; without a cache (training, validation) every factor comes from one stacked
  projection (`factors`) and, under torch.compile, the contractions fuse with RoPE (`contract`);
- from the factors (cached decoding of up to `factor_decode_max_tokens` new tokens): per
  cached token s and head i, with the query's own factors (FlashTPA, paper v3 App. A.4),

      q_i . k_{s,i} = 1/(R_Q R_K) sum_{r', r} A_Q[r', i] A_K[s, r, i] (B_Q[r'] . B_K[s, r])
      o_i = 1/R_V sum_{s, r} P[i, s] A_V[s, r, i] B_V[s, r]

  which costs R_Q R_K d_h + R_Q R_K h + R_K h multiply-adds per cached token for the scores
  (instead of h R_K d_h for each head's full query against B_K) and h R_V d_h for the
  values, and reads only the cached factors, never a per-head K or V for the context.
  For `tpa_kvonly` the query is a full [h, d_h] matrix; factoring it would need rank
  min(h, d_h), which costs more than scoring it against B_K directly (h R_K d_h), so that
  form is used.

Initialization (following the reference recipe, `init_weights`): Xavier-uniform on the
factor maps W_A and W_B; the output projection W_O is zero-initialized like every residual output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from t6.model.attention.base import Attention, KVCache, Options, plain_linear, register, stackable
from t6.model.attention.factor_contract import tpa_contract
from t6.model.attention.fused_decode import tpa_decode
from t6.model.layers import Rotary

if TYPE_CHECKING:  # the model config imports the registry; type hints only
    from t6.model.config import ModelConfig


class Factor(nn.Module):
    """x [B, T, d_model] -> A [B, T, R, h] and B [B, T, R, d_h]: the two factors of one of Q, K, V."""

    def __init__(self, d_model: int, rank: int, n_head: int, head_dim: int):
        super().__init__()
        self.rank, self.n_head, self.head_dim = rank, n_head, head_dim
        self.a = nn.Linear(d_model, rank * n_head, bias=False)
        self.b = nn.Linear(d_model, rank * head_dim, bias=False)

    def init_weights(self) -> None:
        nn.init.xavier_uniform_(self.a.weight)
        nn.init.xavier_uniform_(self.b.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.b(x).unflatten(-1, (self.rank, self.head_dim))  # [B, T, R, d_h]
        return self.head_factor(self.a(x)), b  # [B, T, R, h], [B, T, R, d_h]

    def head_factor(self, a: torch.Tensor) -> torch.Tensor:
        """The head map's output [B, T, R h] -> A [B, T, R, h] (where variants transform A)."""
        return a.unflatten(-1, (self.rank, self.n_head))  # [B, T, R, h]


def contract(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(1/R) A^T B per token: a [B, T, R, h], b [B, T, R, d_h] -> [B, T, h, d_h].

    Eager, a batched matmul over the tokens. Under torch.compile, the sum of the R outer products
    written out: inductor fuses it with the ops around it (RoPE on B, the 1/R, the backward's
    reductions) into one kernel, where a batched matmul with an inner dimension of R = 2..6 is a
    library call of its own in each direction (tests/test_tpa_training.py counts them). Eager, that
    form would materialize [B, T, R, h, d_h]."""
    if torch.compiler.is_compiling():
        return (a[..., None] * b[..., None, :]).sum(2) / a.shape[2]  # [B, T, R, h, d_h] summed over R: [B, T, h, d_h]
    return torch.einsum("btrh,btrd->bthd", a, b) / a.shape[2]  # [B, T, h, d_h]


@dataclass
class TPAOptions(Options):
    q_rank: int | None = 6  # R_Q; None: a standard (unfactorized) query projection
    k_rank: int = 2  # R_K
    v_rank: int = 2  # R_V


@register("tpa")
@register("tpa_kvonly", q_rank=None)
class TensorProductAttention(Attention):
    Options = TPAOptions
    # Cached calls with at most this many new tokens attend from the factors; longer chunks
    # (and prefill without history) materialize K and V for SDPA.
    factor_decode_max_tokens: int = 16
    # Single-token cached steps run the fused operator t6::tpa_decode (one pass over the
    # factors, online softmax; C++ on the CPU, Triton on CUDA) when True, the default: it
    # measured faster than attend_factors from 4k cached tokens on (t6.bench.decode). False
    # keeps them on attend_factors (the eager reference).
    fused_decode: bool = True
    # Materialized Q, K, V (training, prefill) contracted by t6::tpa_contract when True: Triton kernels on CUDA, one
    # pass each way (t6.model.attention.factor_contract). False, the default: `contract`, which inductor fuses with
    # RoPE under torch.compile (docs/performance.md, "TPA's training path": the bytes each moves, and how a GPU
    # decides between them: t6.bench.train_step --triton-contract).
    triton_contract: bool = False
    supports_key_mask = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        h, d = cfg.n_head, cfg.head_dim
        self.k_rank, self.v_rank = self.opts.k_rank, self.opts.v_rank
        self.kv_only = self.opts.q_rank is None
        if self.kv_only:
            self.q = nn.Linear(cfg.d_model, h * d, bias=False)
        else:
            self.q = self.factor(cfg.d_model, self.opts.q_rank, h, d)
        self.k = self.factor(cfg.d_model, self.k_rank, h, d)
        self.v = self.factor(cfg.d_model, self.v_rank, h, d)
        self.out = nn.Linear(h * d, cfg.d_model, bias=False)
        self.rope = Rotary(d, cfg.block_size, cfg.rope_theta, cfg.rope_remap)

    def factor(self, d_model: int, rank: int, n_head: int, head_dim: int) -> Factor:
        """The map from x to one of Q, K, V's factors (variants return their own kind)."""
        return Factor(d_model, rank, n_head, head_dim)

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, init_std) on a standard query, Xavier-uniform on the factor maps W_A and W_B, zero W_O."""
        super().init_weights()
        for module in self.modules():
            if isinstance(module, Factor):
                module.init_weights()

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        h, d = self.cfg.n_head, self.cfg.head_dim
        return {"a_k": (self.k_rank, h), "b_k": (self.k_rank, d), "a_v": (self.v_rank, h), "b_v": (self.v_rank, d)}

    def query_factors(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """x [B, T, d_model] -> (A_Q [B, T, R_Q, h], rotated B_Q [B, T, R_Q, d_h]) for TPA,
        or the rotated full query [B, T, h, d_h] for TPA-KVonly."""
        if self.kv_only:
            B, T, _ = x.shape
            return self.rope(self.q(x).view(B, T, self.cfg.n_head, self.cfg.head_dim), pos)  # [B, T, h, d_h]
        a_q, b_q = self.q(x)  # [B, T, R_Q, h], [B, T, R_Q, d_h]
        return a_q, self.rope(b_q, pos)

    def query(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, T, d_model] -> rotated queries [B, T, h, d_h]."""
        q = self.query_factors(x, pos)
        return q if self.kv_only else contract(*q)  # [B, T, h, d_h]

    def factor_maps(self) -> tuple[list[nn.Module], list[nn.Module], nn.Module]:
        """The factor maps in the order `factors` stacks them: the head factors' (A_Q, A_K, A_V; KVonly: A_K,
        A_V), those whose outputs RoPE rotates (B_Q or the query, then B_K: adjacent), B_V's."""
        heads = [self.k.a, self.v.a] if self.kv_only else [self.q.a, self.k.a, self.v.a]
        return heads, [self.q if self.kv_only else self.q.b, self.k.b], self.v.b

    def stackable(self) -> dict[str, tuple[nn.Module, ...]]:
        heads, rotated, b_v = self.factor_maps()
        return stackable(factors=(*heads, *rotated, b_v))

    def factors(self, x: torch.Tensor, pos: torch.Tensor, stacked=None):
        """Every factor of a whole sequence from one matmul: x [B, T, d_model] -> (the query: A_Q
        [B, T, R_Q, h] and rotated B_Q [B, T, R_Q, d_h], or TPA-KVonly's rotated query [B, T, h, d_h];
        A_K [B, T, R_K, h]; rotated B_K [B, T, R_K, d_h]; A_V [B, T, R_V, h]; B_V [B, T, R_V, d_h]).

        The factor maps' weights are stacked into one projection, (R_Q + R_K + R_V)(h + d_h) wide
        (1,110 at medium), instead of six narrow matmuls; the outputs RoPE rotates (B_Q or the query,
        then B_K) are adjacent in it and rotated in one pass. Only when every map is a plain nn.Linear
        (`plain_linear`): a wrapped map (a LoRA adapter) is called as a module (`module_factors`). stacked: the
        maps' weights stacked already (a fixed-shape decode step's StackedLinear), else stacked here."""
        d = self.cfg.head_dim
        heads, rotated, b_v = self.factor_maps()
        maps = [*heads, *rotated, b_v]
        if stacked is None and not plain_linear(*maps):
            return self.module_factors(x, pos)
        weight = torch.cat([m.weight for m in maps]) if stacked is None else stacked.weight  # [sum of widths, d_model]
        out = F.linear(x, weight)  # [B, T, sum of the maps' widths]
        widths = [m.out_features for m in heads] + [sum(m.out_features for m in rotated), self.v.b.out_features]
        # [B, T, R h] per head factor, [B, T, (R_Q + R_K) d_h] to rotate, [B, T, R_V d_h]
        *a_outs, qk, b_v = out.split(widths, dim=-1)
        qk = self.rope(qk.unflatten(-1, (-1, d)), pos)  # [B, T, R_Q + R_K, d_h] (KVonly: h + R_K)
        q, b_k = qk.split([qk.shape[2] - self.k_rank, self.k_rank], dim=2)  # [B, T, R_Q or h, d_h], [B, T, R_K, d_h]
        a_k, a_v = self.k.head_factor(a_outs[-2]), self.v.head_factor(a_outs[-1])  # [B, T, R_K, h], [B, T, R_V, h]
        b_v = b_v.unflatten(-1, (self.v_rank, d))  # [B, T, R_V, d_h]
        if not self.kv_only:
            q = (self.q.head_factor(a_outs[0]), q)  # ([B, T, R_Q, h], [B, T, R_Q, d_h])
        return q, a_k, b_k, a_v, b_v

    def module_factors(self, x: torch.Tensor, pos: torch.Tensor):
        """`factors`, each factor map called as a module: the same tuple."""
        q = self.query_factors(x, pos)  # TPA: ([B, T, R_Q, h], [B, T, R_Q, d_h]); KVonly: [B, T, h, d_h]
        a_k, b_k = self.k(x)  # [B, T, R_K, h], [B, T, R_K, d_h]
        a_v, b_v = self.v(x)  # [B, T, R_V, h], [B, T, R_V, d_h]
        return q, a_k, self.rope(b_k, pos), a_v, b_v  # keys rotated once, before caching

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        if cache is None:  # whole sequences (training, validation): K and V materialized for SDPA
            y = self.attend_materialized(*self.factors(x, pos), pos, None)  # [B, T, h, d_h]
            return self.project(y.reshape(B, T, -1), x)  # [B, T, d_model]
        stacked = cache.stacked.get("factors")  # a fixed-shape step's: every factor from one matmul
        q, a_k, b_k, a_v, b_v = self.module_factors(x, pos) if stacked is None else self.factors(x, pos, stacked)
        a_k, b_k, a_v, b_v = cache.update(pos, a_k=a_k, b_k=b_k, a_v=a_v, b_v=b_v)  # [B, S, R, *] each
        if T == 1 and self.fused_decode and b_k.shape[1] > 1 and self.recorded is None:
            y = self.decode_fused(
                q, a_k, b_k, a_v, b_v, cache.decode_key_mask(pos), cache.lengths(pos)
            )  # [B, 1, h, d_h]
        elif T <= self.factor_decode_max_tokens and T < b_k.shape[1]:
            y = self.attend_factors(q, a_k, b_k, a_v, b_v, pos, cache.attn_mask(pos))  # [B, T, h, d_h]
        else:
            y = self.attend_materialized(q, a_k, b_k, a_v, b_v, pos, cache)  # [B, T, h, d_h]
        return self.project(y.reshape(B, T, -1), x)  # [B, T, d_model]

    def attend_materialized(self, q, a_k, b_k, a_v, b_v, pos, cache: KVCache | None) -> torch.Tensor:
        """Contract K and V for every cached token [B, S, h, d_h] and attend with SDPA -> [B, T, h, d_h]."""
        pair = self.contraction()  # A [B, S, R, h], B [B, S, R, d_h] -> [B, S, h, d_h]
        q = q if self.kv_only else pair(*q)  # [B, T, h, d_h]
        k, v = self.keys_values(a_k, b_k, a_v, b_v)  # [B, h, S, d_h] each
        y = self.attend(q.transpose(1, 2), k, v, pos, cache)  # [B, h, T, d_h]
        return y.transpose(1, 2)  # [B, T, h, d_h]

    def contraction(self):
        """How this layer contracts materialized factors: t6::tpa_contract where `triton_contract`, else `contract`."""
        return tpa_contract if self.triton_contract else contract

    def keys_values(self, a_k, b_k, a_v, b_v) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V contracted from their factors [B, S, R, *] -> [B, h, S, d_h] each."""
        pair = self.contraction()
        return pair(a_k, b_k).transpose(1, 2), pair(a_v, b_v).transpose(1, 2)

    def cached_keys_values(self, cache: KVCache, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = cache.views(end)
        return self.keys_values(views["a_k"], views["b_k"], views["a_v"], views["b_v"])  # [B, h, end, d_h] each

    def decode_fused(self, q, a_k, b_k, a_v, b_v, key_mask: torch.Tensor | None, lengths=None) -> torch.Tensor:
        """One new token per row through t6::tpa_decode (the same function as attend_factors).

        q: (A_Q [B, 1, R_Q, h], B_Q [B, 1, R_Q, d_h]) or a full query [B, 1, h, d_h] (KVonly);
        the cached factors [B, S, R, *]; key_mask None or bool [B, S] (KVCache.decode_key_mask); lengths None or
        int [B], each row's valid cached tokens (KVCache.lengths). Returns [B, 1, h, d_h].
        """
        R_K, d = a_k.shape[2], b_k.shape[-1]
        if self.kv_only:
            q_a, q_b = None, q[:, 0] * (1.0 / (R_K * math.sqrt(d)))  # [B, h, d_h], scales folded in
        else:
            a_q, b_q = q
            q_a = a_q[:, 0] * (1.0 / (a_q.shape[2] * R_K * math.sqrt(d)))  # [B, R_Q, h], scales folded in
            q_b = b_q[:, 0]  # [B, R_Q, d_h]
        return tpa_decode(q_a, q_b, a_k, b_k, a_v, b_v, key_mask, lengths)[:, None]  # [B, 1, h, d_h]

    def attend_factors(self, q, a_k, b_k, a_v, b_v, pos, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention computed from the cached factors, never forming per-head K or V.

        q: (A_Q [B, T, R_Q, h], B_Q [B, T, R_Q, d_h]) or a full query [B, T, h, d_h] (KVonly);
        a_k [B, S, R_K, h], b_k [B, S, R_K, d_h], a_v [B, S, R_V, h], b_v [B, S, R_V, d_h];
        mask: None (every query sees every cached token) or bool [B or 1, T, S].
        Returns [B, T, h, d_h]. The reshapes below are views when T = 1.
        """
        B, S, R_K, h = a_k.shape
        d, R_V = b_k.shape[-1], a_v.shape[2]
        b_k_flat = b_k.reshape(B, S * R_K, d)  # [B, S R_K, d_h]
        if self.kv_only:
            T = q.shape[1]
            q = q * (1.0 / (R_K * math.sqrt(d)))  # fold the scales into the (small) query
            # each head's query against each key factor: [B, S R_K, d_h] x [B, d_h, T h]
            qb = torch.bmm(b_k_flat, q.reshape(B, T * h, d).transpose(1, 2))  # [B, S R_K, T h]
            qb = qb.view(B, S, R_K, T, h).permute(0, 3, 1, 2, 4)  # [B, T, S, R_K, h]
        else:
            a_q, b_q = q
            T, R_Q = a_q.shape[1], a_q.shape[2]
            a_q = a_q * (1.0 / (R_Q * R_K * math.sqrt(d)))  # fold the scales into the (small) query factor
            g = torch.bmm(b_k_flat, b_q.reshape(B, T * R_Q, d).transpose(1, 2))  # B_K . B_Q: [B, S R_K, T R_Q]
            g = g.view(B, S * R_K, T, R_Q).transpose(1, 2).reshape(B * T, S * R_K, R_Q)  # [B T, S R_K, R_Q]
            # fold in the query's head factor: [B T, S R_K, R_Q] x [B T, R_Q, h]
            qb = torch.bmm(g, a_q.reshape(B * T, R_Q, h)).view(B, T, S, R_K, h)  # [B, T, S, R_K, h]
        scores = qb[:, :, :, 0] * a_k[:, None, :, 0]  # [B, T, S, h]
        for r in range(1, R_K):  # sum over the key rank
            scores.addcmul_(qb[:, :, :, r], a_k[:, None, :, r])  # [B, T, S, h]
        if mask is not None:
            scores.masked_fill_(~mask[..., None], float("-inf"))  # [B, T, S, h]
        scores = scores.sub_(scores.amax(dim=2, keepdim=True)).exp_()  # unnormalized softmax over S: [B, T, S, h]
        denom = scores.sum(dim=2)  # [B, T, h]
        if self.recorded is not None:
            self.recorded.append((scores / denom[:, :, None]).permute(0, 3, 1, 2))  # probabilities [B, h, T, S]
        w = scores[:, :, :, None, :] * a_v[:, None]  # P[i, s] A_V[s, r, i]: [B, T, S, R_V, h]
        w = w.reshape(B, T, S * R_V, h).transpose(2, 3).reshape(B, T * h, S * R_V)  # [B, T h, S R_V]
        y = torch.bmm(w, b_v.reshape(B, S * R_V, d)).view(B, T, h, d)  # sum over (s, r): [B, T, h, d_h]
        return y / (denom[..., None] * R_V)  # [B, T, h, d_h]
