"""The interface every attention mechanism implements, and the KV cache they share.

An attention maps x [B, T, d_model] at absolute positions `pos` [T] to [B, T, d_model].
It declares what it caches per token (`cache_spec`), so the model can allocate the cache
once (`build_kv_cache`) and the attention writes into it in place at `pos`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

if TYPE_CHECKING:  # the model config imports the registry; type hints only
    from t6.model.config import ModelConfig


# The output gate (`Options.output_gate`, `Attention.project`): none, one sigmoid per head, one per output number.
OUTPUT_GATES = ("none", "headwise", "elementwise")


@dataclass
class Options:
    """A mechanism's options: subclass it with typed fields and their defaults, the one place
    they live. Hydra shows them as `attention.options.*` (t6.hydra_config stores each registered name's
    options, presets applied, as the attention group's defaults). `problems` validates them
    against the model config; int fields must be positive (or None where the type allows it).

    The fields here every mechanism has: `output_gate` (Qiu et al. 2025, arXiv 2505.06708, position G1): each
    head's attention output times sigmoid(x W_g), x the layer's input (the block's normalized hidden state),
    before the output projection; `headwise` one gate per head, `elementwise` one per output number (the
    paper's best); `Attention.project` applies it."""

    output_gate: str = "none"  # none | headwise | elementwise

    def problems(self, cfg: ModelConfig) -> list[str]:
        out = []
        for f in fields(self):
            value, kind = getattr(self, f.name), str(f.type)
            if value is None and "None" in kind:
                continue
            if kind.startswith("int") and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                out.append(f"attention.options.{f.name}={value!r} must be a positive integer")
        if self.output_gate not in OUTPUT_GATES:
            out.append(f"attention.options.output_gate={self.output_gate!r} must be one of {list(OUTPUT_GATES)}")
        return out


@dataclass(frozen=True)
class Mechanism:
    """A registered name: its class and the options the name fixes (a preset, e.g. mha = GQA
    with one KV head per query head)."""

    name: str
    cls: type[Attention]
    preset: dict[str, Any]

    def default_options(self) -> dict[str, Any]:
        """Every option with its default for this name (the preset applied)."""
        return {**asdict(self.cls.Options()), **self.preset}

    def options(self, given: dict[str, Any]) -> tuple[Options | None, list[str]]:
        """(options, problems) from the options a config gives."""
        known = {f.name for f in fields(self.cls.Options)}
        problems = [
            f"attention.options.{k} is not an option of attention={self.name} (options: {sorted(known)})"
            for k in given
            if k not in known
        ]
        problems += [
            f"attention.options.{k}={given[k]!r}: attention={self.name} fixes it to {v!r}"
            for k, v in self.preset.items()
            if k in given and given[k] != v
        ]
        if problems:
            return None, problems
        return self.cls.Options(**{**given, **self.preset}), []


registry: dict[str, Mechanism] = {}


def register(name: str, **preset: Any):
    """Class decorator: make an attention selectable as `attention=<name>`, with `preset` fixing
    some of its options (stack one decorator per name)."""

    def wrap(cls: type[Attention]) -> type[Attention]:
        if name in registry and registry[name].cls is not cls:
            raise ValueError(
                f"attention name {name!r} registered twice ({registry[name].cls.__name__}, {cls.__name__})"
            )
        unknown = set(preset) - {f.name for f in fields(cls.Options)}
        if unknown:
            raise ValueError(f"attention {name!r}: preset {sorted(unknown)} are not fields of {cls.Options.__name__}")
        registry[name] = Mechanism(name, cls, dict(preset))
        return cls

    return wrap


class KVCache:
    """Per-layer cache: one preallocated tensor per cached quantity, the sequence along dim 1
    ([B, max_len, *shape], token-major) or, for names in `head_major`, along dim 2
    ([B, n, max_len, *rest] for a per-token shape (n, *rest): each head's keys contiguous,
    the layout SDPA and the decode kernels read fastest).

    The shapes come from the attention's `cache_spec`, so the per-token element count of
    the cache is whatever the mechanism really stores (K/V heads, latents or factors).

    Two ways to decode against it. Dynamic shapes (the default): `update` and `attn_mask` reach
    exactly the last written position, so each new token changes the shapes. Fixed shapes
    (`static_len` set, `T6.decode_step`): they always reach `static_len` positions, the positions
    after the newest one are masked, and `pos` stays on the device, so every step of a generation
    runs the same graph (compiled once, captured as a CUDA graph).
    """

    def __init__(
        self,
        spec: dict[str, tuple[int, ...]],
        batch_size: int,
        max_len: int,
        dtype=None,
        device=None,
        head_major: tuple[str, ...] = (),
    ):
        self.max_len = max_len
        self.spec = dict(spec)
        self.seq_dims = {name: 2 if name in head_major else 1 for name in spec}
        # Optional bool [B, max_len]: False marks padding (left-padded prompts of different
        # lengths); attentions with `supports_key_mask` never attend to those positions.
        self.key_mask: torch.Tensor | None = None
        # Fixed-shape decoding: views and masks `static_len` positions long whatever pos is (a power-of-two
        # bucket, see t6.model.static_decode); None: they end at the last written position.
        self.static_len: int | None = None
        # A compiled fixed-shape step attends through FlexAttention (`flex_decode`) when True; otherwise, and in
        # every eager step, SDPA with the mask of `attn_mask` (t6.model.static_decode.FixedStep sets it).
        self.flex_decode = False
        self._known_end: tuple[torch.Tensor, int] | None = None  # see `expect`
        self._lengths: tuple[torch.Tensor, torch.Tensor] | None = None  # see `share_lengths`
        # A fixed-shape step's stacked projections of this layer (StaticDecoder sets them: `Attention.stackable`,
        # SwiGLU's), by the name their module looks them up under; empty: each projection runs as a module.
        self.stacked: dict[str, StackedLinear] = {}
        self.tensors = {}
        for name, shape in spec.items():
            if name in head_major:
                full = (batch_size, shape[0], max_len, *shape[1:])  # [B, n, max_len, *rest]
            else:
                full = (batch_size, max_len, *shape)  # [B, max_len, *shape]
            self.tensors[name] = torch.zeros(full, dtype=dtype, device=device)

    def expect(self, pos: torch.Tensor, end: int) -> None:
        """The model built `pos` from Python ints and says where it ends (pos[-1] + 1 = end): `update`
        and `attn_mask` take `end` from here for that tensor instead of reading pos[-1] back, which on
        a GPU makes the host wait for the device, twice per layer and token."""
        self._known_end = (pos, end)

    def from_start(self, pos: torch.Tensor) -> bool:
        """Whether pos [T] are the positions 0..T-1 of an unpadded prefill (nothing cached before them, no
        padding mask), as the model said through `expect` (never read from the device; False when unknown):
        attention over the new tokens alone is then the whole attention, causal."""
        known = self._known_end
        return (
            self.static_len is None
            and self.key_mask is None
            and known is not None
            and known[0] is pos
            and known[1] == len(pos)
        )

    def _end(self, pos: torch.Tensor) -> int:
        if self.static_len is not None:
            return self.static_len
        known = self._known_end
        return known[1] if known is not None and known[0] is pos else int(pos[-1]) + 1

    def update(self, pos: torch.Tensor, **new: torch.Tensor) -> list[torch.Tensor]:
        """Write new[name] [B, T, *shape] at positions pos [T]; return each cache up to pos[-1]
        (or static_len positions) in its own layout: [B, end, *shape] (token-major) or
        [B, n, end, *rest] (head-major)."""
        end = self._end(pos)
        if end > self.max_len:
            raise ValueError(f"position {end - 1} is past the KV cache length {self.max_len}")
        views = []
        for name, value in new.items():
            cache = self.tensors[name]
            if self.seq_dims[name] == 2:
                cache[:, :, pos] = value.transpose(1, 2).to(cache.dtype)  # in place: [B, n, T, *rest]
                views.append(cache[:, :, :end])  # [B, n, end, *rest]
            else:
                cache[:, pos] = value.to(cache.dtype)  # in place: [B, T, ...] into [B, max_len, ...]
                views.append(cache[:, :end])  # [B, end, ...]
        return views

    def views(self, end: int) -> dict[str, torch.Tensor]:
        """Each cached quantity's first `end` positions in its own layout, as `update` returns them: [B, end, *shape]
        (token-major) or [B, n, end, *rest] (head-major); views, no copy."""
        return {name: tensor.narrow(self.seq_dims[name], 0, end) for name, tensor in self.tensors.items()}

    def select(self, index: torch.Tensor) -> KVCache:
        """A new cache holding rows `index` [B'] of this one (e.g. one prefilled context
        repeated for each of its continuations); the padding mask follows."""
        out = object.__new__(KVCache)
        out.max_len, out.spec, out.seq_dims = self.max_len, dict(self.spec), dict(self.seq_dims)
        out.tensors = {name: t.index_select(0, index) for name, t in self.tensors.items()}  # [B', ...]
        out.key_mask = None if self.key_mask is None else self.key_mask.index_select(0, index)  # [B', max_len]
        out.static_len, out._known_end, out._lengths, out.flex_decode, out.stacked = None, None, None, False, {}
        return out

    def attn_mask(self, pos: torch.Tensor) -> torch.Tensor | None:
        """Bool [B or 1, T, end] for new queries at positions pos [T] against the cache up to
        pos[-1] (or static_len positions): causal, and blind to padding (a padded query sees itself,
        so it stays finite). None when every query may see every cached token (one new token, no
        padding, dynamic shapes)."""
        end = self._end(pos)
        mask = causal_mask(pos, end)[None] if len(pos) > 1 or self.static_len is not None else None  # [1, T, end]
        if self.key_mask is not None:
            keys = self.key_mask[:, None, :end]  # [B, 1, end]
            self_pos = torch.arange(end, device=pos.device)[None, None, :] == pos[None, :, None]  # [1, T, end]
            mask = (keys if mask is None else mask & keys) | self_pos  # [B, T, end]
        return mask

    def lengths(self, pos: torch.Tensor) -> torch.Tensor | None:
        """The fused decode operators' `lengths` for queries at pos [T]: in a fixed-shape step each row's
        cached tokens up to the newest, int64 [B] on the device, so their kernels skip the rest of the view;
        None with dynamic shapes, whose views end there already. The tensor the model shared for this pos
        (`share_lengths`: one for every layer) where it did."""
        if self.static_len is None:
            return None
        if self._lengths is not None and self._lengths[0] is pos:
            return self._lengths[1]
        return self.count(pos)

    def count(self, pos: torch.Tensor) -> torch.Tensor:
        """Each row's cached tokens up to the newest of pos [T]: int64 [B] on the device, computed now."""
        B = next(iter(self.tensors.values())).shape[0]
        return (pos[-1] + 1).expand(B).contiguous()  # [B]

    def share_lengths(self, pos: torch.Tensor, lengths: torch.Tensor) -> None:
        """`lengths(pos)`, computed once by the model for every layer's cache of a fixed-shape step (`count`, at
        each step: pos changes in place): each layer reads that tensor instead of computing its own, two kernels
        fewer per layer and step."""
        self._lengths = (pos, lengths)

    def decode_key_mask(self, pos: torch.Tensor) -> torch.Tensor | None:
        """What a single new token at pos [1] must not see, as the fused decode operators take it: bool [B, S]
        over the positions `update` returned, or None. A fixed-shape step's is the key mask itself, read where it
        lies (no work on the device: its new token is never padding, and `lengths` bounds what follows it);
        otherwise `attn_mask`'s one row."""
        if self.static_len is not None:
            return None if self.key_mask is None else self.key_mask[:, : self.static_len]  # [B, S]
        mask = self.attn_mask(pos)  # [B or 1, 1, S] or None
        B = next(iter(self.tensors.values())).shape[0]
        return None if mask is None else mask[:, 0].expand(B, -1)  # [B, S]

    def mask_mod(self, pos: torch.Tensor):
        """`attn_mask` as FlexAttention's mask_mod: (batch row b, head h, query index q_idx, key position
        kv_idx) -> whether the query may see the key, evaluated inside the attention kernel, the mask never
        built."""
        key_mask = self.key_mask

        def visible(b, h, q_idx, kv_idx):
            causal = kv_idx <= pos[q_idx]
            if key_mask is None:
                return causal
            return causal & key_mask[b, kv_idx] | (kv_idx == pos[q_idx])

        return visible

    def elements_per_token(self) -> int:
        return sum(math.prod(shape) for shape in self.spec.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def plain_linear(*modules: nn.Module) -> bool:
    """Whether each module is exactly an nn.Linear with no hooks and no replaced forward: then its weight is all
    it computes, and a caller may use the weight itself (stack it with others into one matmul, fold it into
    another product). A wrapped or hooked projection (a PEFT LoRA adapter, a quantized or offloaded layer) is
    not: it must be called as a module, so that what it adds acts on that path too."""
    return all(
        type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks and "forward" not in vars(m)
        for m in modules
    )


class StackedLinear:
    """Bias-free projections of one input applied as one matmul (a fixed-shape decode step's fewer, larger
    kernels): their weights stacked [sum of their outputs, in] into one buffer at a fixed address, which a CUDA
    graph reads where it is and `refresh()` rewrites in place (t6.model.static_decode.StaticDecoder refreshes at
    each generation's start: the weights may have been trained since). Only for plain nn.Linear modules
    (`plain_linear`): a wrapped or hooked one must be called as a module (`Attention.stackable`)."""

    def __init__(self, modules: tuple[nn.Module, ...]):
        self.modules = modules
        self.widths = [m.out_features for m in modules]
        self.weight = torch.cat([m.weight.detach() for m in modules])  # [sum of the outputs, in]

    def refresh(self) -> None:
        torch.cat([m.weight.detach() for m in self.modules], out=self.weight)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> every projection's output side by side [..., sum of the outputs]."""
        return nn.functional.linear(x, self.weight)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., in] -> each projection's output [..., out_i], views of one matmul's."""
        return self.matmul(x).split(self.widths, dim=-1)


def stackable(**groups: tuple[nn.Module, ...]) -> dict[str, tuple[nn.Module, ...]]:
    """The groups whose modules are all plain nn.Linear (`plain_linear`), each stacked by a fixed-shape decode
    step (`StackedLinear`); a group with a wrapped or hooked module is left out, so its modules run as modules."""
    return {name: modules for name, modules in groups.items() if plain_linear(*modules)}


def linear_weight(module: nn.Module, in_features: int) -> torch.Tensor:
    """The matrix [out, in] a bias-free projection applies: a plain nn.Linear's weight, else the module applied
    to the identity (a LoRA adapter: W + s B A), so a path that reads the matrix (MLA's absorbed decoding)
    computes what calling the module computes."""
    if plain_linear(module):
        return module.weight
    p = next(module.parameters())
    return module(torch.eye(in_features, dtype=p.dtype, device=p.device)).T  # [out, in]


def sdpa_broadcasts_groups(device_type: str, dtype: torch.dtype) -> bool:
    """Whether SDPA's fast kernels take grouped K/V heads as they are (enable_gqa) for queries: on the CPU
    yes; on CUDA only FlashAttention does (fp16/bf16). An fp32 CUDA input would fall back to the math
    kernel, which keeps [B, h, T, T] scores per layer for backward; expanded K/V [B, h, T, d] run the
    memory-efficient kernel instead."""
    return device_type != "cuda" or dtype in (torch.float16, torch.bfloat16)


def causal_mask(pos: torch.Tensor, end: int) -> torch.Tensor:
    """Boolean mask [T, end]: query at absolute position pos[i] may see keys 0..pos[i]."""
    return torch.arange(end, device=pos.device)[None, :] <= pos[:, None]


# The attention kernels, chosen per phase rather than left to SDPA's dispatcher:
# - training (gradients flowing; fixed block_size windows, so each shape is planned once): SDPA's own order,
#   on Hopper cuDNN attention first;
# - inference with changing shapes (prefill, evaluation, eager decoding: new shapes for every prompt and
#   token): FlashAttention, the memory-efficient kernel where a mask or fp32 rules Flash out, then math;
#   never cuDNN attention, which plans again for every new shape (2.66 ms of host time per token measured on
#   an H100; for grouped heads its kernel also ran 6.7x slower than MHA's at 32k);
# - fixed-shape decode steps (KVCache.static_len): compiled, FlexAttention (`flex_decode`, where
#   KVCache.flex_decode says so); eager (a step captured as a CUDA graph without compiling), SDPA with the
#   cache's mask, as the inference phase above.
# On the CPU, SDPA's dispatcher chooses in every phase (its flash kernel, else math).
INFERENCE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention (same arguments and result) on the backends of its phase, above."""
    if q.device.type != "cuda" or torch.is_grad_enabled():
        return nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(INFERENCE_SDPA_BACKENDS):
        return nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)


FLEX_BLOCK = 128  # keys per block of flex_decode's block mask (FlexAttention's default)


def flex_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod, newest: torch.Tensor) -> torch.Tensor:
    """Attention of a fixed-shape decode step through FlexAttention: compiled, its decoding kernel splits
    the keys across the GPU, reads each K/V head once for all the query heads of its group, and skips
    the key blocks after the newest token, so a cache view longer than the context costs no reads.

    q [B, h, T, d]; k, v [B, h_kv, L, d] (h divisible by h_kv); mask_mod: KVCache.mask_mod;
    newest: the newest position, a device tensor []. Returns [B, h, T, d_v].

    The decoding kernel takes a power of two query heads per K/V head (otherwise FlexAttention runs its
    general kernel, one program per query head); other groups (MQA's 31 heads, GQA's 15 per K/V head at
    medium) get zero query heads up to the next power of two, whose outputs are dropped.
    """
    B, h, T, d = q.shape
    h_kv, L = k.shape[1], k.shape[2]
    g = h // h_kv  # query heads per K/V head
    g_pow2 = 1 << (g - 1).bit_length()
    if g_pow2 != g:  # each group's heads (adjacent), then its zero heads
        zeros = q.new_zeros(B, g_pow2 - g, T, d)  # [B, g' - g, T, d]
        q = torch.cat([t for j in range(h_kv) for t in (q[:, j * g : (j + 1) * g], zeros)], dim=1)  # [B, h_kv g', T, d]
    n = -(-L // FLEX_BLOCK)  # key blocks
    visited = (newest // FLEX_BLOCK + 1).to(torch.int32).expand(B, 1, 1).contiguous()  # [B, 1, 1]: blocks to the newest
    order = torch.arange(n, dtype=torch.int32, device=q.device).expand(B, 1, 1, n).contiguous()  # [B, 1, 1, n]
    blocks = BlockMask.from_kv_blocks(
        visited, order, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(T, L), compute_q_blocks=False
    )
    y = flex_attention(q, k, v, block_mask=blocks, enable_gqa=g_pow2 > 1)  # [B, h_kv g', T, d_v]
    if g_pow2 != g:
        y = y.reshape(B, h_kv, g_pow2, T, -1)[:, :, :g].reshape(B, h, T, -1)  # [B, h, T, d_v]
    return y


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, cached) -> torch.Tensor:
    """Causal softmax attention with SDPA, or FlexAttention in a compiled fixed-shape decode step (the
    kernels of each phase: see INFERENCE_SDPA_BACKENDS).

    q: [B, h, T, d]; k, v: [B, h_kv, S, d] with h divisible by h_kv. Grouped heads are
    broadcast by SDPA (enable_gqa) in causal self-attention; against a cache, each group's
    query heads are folded into the query length instead, so K and V are never expanded.
    `cached`: the layer's KVCache (its padding mask is honoured), or a bool/None. Returns [B, h, T, d_v].
    """
    if isinstance(cached, KVCache) and cached.static_len is not None and cached.flex_decode:
        return flex_decode(q, k, v, cached.mask_mod(pos), pos[-1])  # [B, h, T, d_v]
    T, S = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    padded = isinstance(cached, KVCache) and cached.key_mask is not None
    if not padded and (not cached or T == S):
        if gqa and not sdpa_broadcasts_groups(q.device.type, q.dtype):
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [B, h, S, d] each
            gqa = False
        causal = True if T > 1 else False  # a branch, so a Python bool also under dynamic shapes (a guard)
        return sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)
    if isinstance(cached, KVCache):
        mask = cached.attn_mask(pos)  # [B or 1, T, S] or None
    else:
        mask = None if T == 1 else causal_mask(pos, S)[None]  # a single new token sees the whole cache
    if gqa:  # fold each group's query heads into the query length: K/V are read once per KV head, never copied
        B, h, _, d = q.shape
        g = h // k.shape[1]
        q = q.reshape(B, k.shape[1], g * T, d)  # [B, h_kv, g T, d] (heads of a group are adjacent)
        mask = None if mask is None else mask.repeat(1, g, 1)  # [B or 1, g T, S]
    mask = None if mask is None else mask[:, None]  # [B or 1, 1, T', S], broadcast over heads
    y = sdpa(q, k, v, attn_mask=mask)  # [B, h_kv, g T, d_v] or [B, h, T, d_v]
    return y.reshape(y.shape[0], -1, T, y.shape[-1])  # [B, h, T, d_v]


class Attention(nn.Module):
    """Base class. Subclasses declare `Options`, set up their projections in __init__ (the output projection
    named `out`) and implement cache_spec and forward, which ends with `self.project(y, x)`: the heads' outputs
    through the output gate, if any, and `out`; `init_weights` initializes their own layers."""

    Options: ClassVar[type[Options]] = Options
    # True when the mechanism honours KVCache.key_mask (needed for batched prompts of different lengths).
    supports_key_mask: ClassVar[bool] = False
    # Cached quantities stored head-major ([B, n, max_len, ...], see KVCache).
    head_major_cache: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.opts = cfg.options()  # this mechanism's Options, validated by ModelConfig
        # A list while a caller wants the attention probabilities (transformers' output_attentions): each forward
        # appends its [B, h, T, S] (`attend` and `record_attention`); None, the default, computes none.
        self.recorded: list[torch.Tensor] | None = None
        self.gate: nn.Linear | None = None  # the output gate's W_g (`add_output_gate`, after the subclass's __init__)
        self.depth = 0  # the index of the block it is in, from 0 (T6 sets it): for mechanisms that depend on it (DIFF)

    def __init_subclass__(cls, **kwargs):
        """Every subclass's __init__, once it has run for the object's own class, adds the output gate: the gate
        is sized by `out`, which the subclass builds, and lives here for every mechanism."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def __init__(self, *args, **kw):
            init(self, *args, **kw)
            if type(self).__init__ is __init__:  # the outermost __init__ of this object: the projections exist
                self.add_output_gate()

        cls.__init__ = __init__

    def add_output_gate(self) -> None:
        """W_g: d_model -> one gate per head (headwise) or per input of `out` (elementwise), no bias, as the paper."""
        kind = self.opts.output_gate
        if kind != "none":
            width = self.cfg.n_head if kind == "headwise" else self.out.in_features
            self.gate = nn.Linear(self.cfg.d_model, width, bias=False)

    def project(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The heads' outputs y [B, T, h d_v] (heads concatenated) through the output gate sigmoid(x W_g), x the
        layer's input [B, T, d_model], then the output projection -> [B, T, d_model]."""
        if self.gate is not None:
            g = torch.sigmoid(self.gate(x))  # [B, T, h] (headwise) or [B, T, h d_v] (elementwise)
            if g.shape[-1] != y.shape[-1]:  # headwise: one gate for each head's d_v numbers
                g = g.repeat_interleave(y.shape[-1] // g.shape[-1], dim=-1)  # [B, T, h d_v]
            y = y * g  # [B, T, h d_v]
        return self.out(y)  # [B, T, d_model]

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, init_std) on every projection, ones on norms, zeros on the output projection W_O
        (so each block starts as the identity). Mechanisms with other needs override this."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.cfg.init_std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.zeros_(self.out.weight)

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        """Per-token shape of each tensor this mechanism caches for decoding."""
        raise NotImplementedError

    def stackable(self) -> dict[str, tuple[nn.Module, ...]]:
        """The projections of one input that a fixed-shape decode step may apply as one matmul, by name (`stackable`
        of base: plain ones only); the forward finds them in `cache.stacked` under that name. None by default."""
        return {}

    def build_kv_cache(self, batch_size: int, max_len: int, dtype=None, device=None) -> KVCache:
        return KVCache(
            self.cache_spec(), batch_size, max_len, dtype=dtype, device=device, head_major=self.head_major_cache
        )

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        raise NotImplementedError

    def cached_keys_values(self, cache: KVCache, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values this attention scores and averages for the first `end` tokens of its cache: keys
        [B, h_kv, end, d_k], values [B, h_kv, end, d_v], each of the h_kv heads serving h / h_kv query heads (h_kv = h
        where every head has its own). A mechanism that caches K and V returns them (views of the cache); one that
        caches factors or latents computes them from those, with its forward's formulas (new tensors). Decoding
        never calls it: it is what others read as the cache's keys and values (the Hugging Face export's
        `T6CacheLayer.keys`)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not say which keys and values its cache holds (Attention.cached_keys_values)"
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, cached) -> torch.Tensor:
        """`attend` (the module's function: causal softmax attention, q [B, h, T, d], k, v [B, h_kv, S, d] ->
        [B, h, T, d_v]); while `recorded` is a list, computed explicitly and its probabilities recorded."""
        if self.recorded is None:
            return attend(q, k, v, pos, cached)
        T, S = q.shape[2], k.shape[2]
        if isinstance(cached, KVCache):
            mask = cached.attn_mask(pos)  # [B or 1, T, S] or None
        elif T == S:  # self-attention: causal among the tokens
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()[None]  # [1, T, S]
        else:  # new tokens against earlier ones, at positions 0..S-1
            mask = None if T == 1 else causal_mask(pos, S)[None]  # [1, T, S]
        return self.record_attention(q, k, v, mask)

    def record_attention(self, q, k, v, mask: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
        """Softmax attention written out, its probabilities appended to `recorded`: q [B, h, T, d], k [B, h_kv, S, d],
        v [B, h_kv, S, d_v] (h divisible by h_kv), mask None or bool [B or 1, T, S] -> [B, h, T, d_v]."""
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [B, h, S, *]
        scores = (q @ k.transpose(2, 3)).float() * (scale or q.shape[-1] ** -0.5)  # [B, h, T, S]
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None], float("-inf"))  # [B, h, T, S]
        probs = scores.softmax(dim=-1)  # [B, h, T, S]
        self.recorded.append(probs)
        return (probs.to(v.dtype) @ v).to(q.dtype)  # [B, h, T, d_v]
