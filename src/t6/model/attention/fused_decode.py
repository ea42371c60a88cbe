"""Fused single-token decoding from the cache: the PyTorch custom operators `t6::tpa_decode`
(TPA and TPA-KVonly, from the cached factors) and `t6::latent_decode` (MLA's and GLA's absorbed form),
registered with torch.library: schema, CPU implementation, fake (meta) implementation.

One pass over the cache in blocks of tokens with an online (streaming) softmax, the cached
sequence split across threads and the partial softmaxes combined (split-K), so nothing
proportional to the context is written. Per cached token s and head i (TPA):

    scores[s, i] = sum_r A_K[s, r, i] qb[s, r, i],  qb[s, r, i] = sum_r' (B_K[s, r] . B_Q[r']) A_Q[r', i]
                                                 (or B_K[s, r] . q_i for a full query, TPA-KVonly)
    m, l, acc    <- running max, denominator and [h, d_h] numerator, rescaled by exp(m_old - m_new)
    acc[i, :]   += sum_r P[s, i] A_V[s, r, i] B_V[s, r, :]    (register tiles: 4-6 heads x 2-4 vectors)

and the result is acc / (l R_V). MLA: scores[s, i] = q_lat[i] . c_kv[s] + q_rope[i] . k_rope[s],
acc[i, :] += P[s, i] c_kv[s, :]. The query scales are folded into the query by the caller.

The CPU implementation is C++ (csrc/fused_decode.cpp: both operators written on float vectors of
the machine's width with GCC/Clang vector extensions; threads from ATen's OpenMP pool), compiled
by torch.utils.cpp_extension into the user's torch extensions cache (`TORCH_EXTENSIONS_DIR`,
default ~/.cache/torch_extensions; needs g++, the Python headers and ninja, pinned in pyproject):
`make install` builds it, otherwise the first decode does. Where it
cannot be built, the operators run `reference_tpa_decode` / `reference_latent_decode`, the eager
form, with one warning. On CUDA the Triton kernels of `t6.model.attention.triton_decode`
implement the same operators (and on the CPU under Triton's interpreter, TRITON_INTERPRET=1, as for
Liger's kernel: how the tests run them); where a kernel fails at its first launch (out of shared memory
or registers, a compiler error), the operators run the eager reference from then on (t6.model.fallback
"triton_decode").

Both operators take optional `lengths` [B] (int32 or int64, on the cache's device): row b attends to
its first lengths[b] cached tokens only, so a caller with a preallocated cache passes the whole cache
(a fixed shape, as a CUDA graph needs) and the rows' lengths as a device tensor. The CUDA kernels never
read past a row's length. The CPU implementations read the lengths (a host read is free there), cut the
cache at the longest row and hide the other rows' positions past their lengths with the key mask: those
positions are read with weight zero, so they must hold finite values (KVCache's caches start as zeros).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import warnings
from pathlib import Path

import torch
from torch.utils.flop_counter import register_flop_formula

from t6.model.fallback import enabled, fell_back

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc" / "fused_decode.cpp"
# Built on the machine that runs it, for its own vector units (on x86, 512-bit vectors where
# AVX-512 exists: the value tiles are sized for them).
CFLAGS = ["-O3", "-march=native", "-fopenmp"] + (
    ["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []
)
LDFLAGS = ["-fopenmp"]  # ATen's OpenMP pool runs the threads


def cpu_features() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (/proc/cpuinfo), else its name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keys = ("model name", "flags", "Features", "CPU part")  # x86; ARM names its features and part
    return "|".join(sorted({line for line in lines if line.split(":")[0].strip() in keys}))


def build_directory() -> Path:
    """The kernels' build folder in the torch extensions cache: one per copy of this source, Python,
    torch and CPU (a home directory shared by machines with other vector units gets one build each:
    an AVX-512 build would stop an AVX2 machine with an illegal instruction)."""
    from torch.utils import cpp_extension

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    key = f"{CSRC}|{sys.version}|{torch.__version__}|{cpu_features()}"
    tag = hashlib.sha1(key.encode()).hexdigest()[:10]
    return root / f"t6_fused_decode_{tag}"


@functools.cache
def cpu_extension():
    """The compiled CPU kernels (built once per machine and cached), or None where they cannot be built."""
    from torch.utils import cpp_extension

    build_dir = build_directory()
    if not (build_dir / "t6_fused_decode.so").is_file():  # said once per machine, when it compiles
        log.info("t6: compiling the fused CPU decode kernels (once per machine, about a minute)")
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        # torch's own build lock is a file that a killed build leaves behind, after which every later
        # load waits for it forever; this lock is released by the OS when its holder dies, and whoever
        # holds it may remove a leftover torch lock.
        with open(build_dir / "t6.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            return cpp_extension.load(
                name="t6_fused_decode",
                sources=[str(CSRC)],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as err:  # no compiler, headers or ninja: the eager reference still decodes
        warnings.warn(
            f"t6: the fused CPU decode kernels could not be built ({type(err).__name__}: {err}); "
            "decoding uses the eager reference path",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def check_lengths(lengths: torch.Tensor | None, B: int) -> None:
    if lengths is not None and (lengths.shape != (B,) or lengths.dtype not in (torch.int32, torch.int64)):
        raise ValueError(
            f"lengths must be an int32 or int64 tensor [B] = [{B}] (each row's valid cached tokens), "
            f"got {lengths.dtype} {tuple(lengths.shape)}"
        )


def within_lengths(lengths: torch.Tensor, key_mask: torch.Tensor | None, S: int) -> tuple[int, torch.Tensor]:
    """The CPU form of `lengths` [B]: (n, the longest row's length capped at S; the key mask [B, n] that
    also hides each row's positions at or past its own length). Reads the lengths on the host."""
    n = min(int(lengths.max()), S)
    valid = torch.arange(n, device=lengths.device) < lengths[:, None]  # [B, n]
    return n, valid if key_mask is None else valid & key_mask[:, :n]  # [B, n]


@torch.library.custom_op("t6::tpa_decode", mutates_args=())
def tpa_decode(
    q_a: torch.Tensor | None,
    q_b: torch.Tensor,
    a_k: torch.Tensor,
    b_k: torch.Tensor,
    a_v: torch.Tensor,
    b_v: torch.Tensor,
    key_mask: torch.Tensor | None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new query per row against S cached tokens -> [B, h, d_h] (normalized by 1/R_V).

    q_a: A_Q [B, R_Q, h] (scaled) with q_b = rotated B_Q [B, R_Q, d_h]; or q_a None and
    q_b a full query [B, h, d_h] (scaled). a_k [B, S, R_K, h], b_k [B, S, R_K, d_h],
    a_v [B, S, R_V, h], b_v [B, S, R_V, d_h]: the cache (views up to the new token included).
    key_mask: None or bool [B, S], False where the query must not look (padding).
    lengths: None or int [B]: row b attends to its first lengths[b] cached tokens only.
    """
    check_lengths(lengths, a_k.shape[0])
    if triton_interpreted():
        return triton_or_reference("tpa_decode", q_a, q_b, a_k, b_k, a_v, b_v, key_mask, lengths)
    if lengths is not None:
        n, key_mask = within_lengths(lengths, key_mask, a_k.shape[1])
        a_k, b_k, a_v, b_v = a_k[:, :n], b_k[:, :n], a_v[:, :n], b_v[:, :n]  # [B, n, R, *]
    ext = cpu_extension() if q_b.device.type == "cpu" else None
    if ext is None:
        return reference_tpa_decode(q_a, q_b, a_k, b_k, a_v, b_v, key_mask)
    return ext.tpa_decode(q_a, q_b, a_k, b_k, a_v, b_v, key_mask)


@tpa_decode.register_fake
def _(q_a, q_b, a_k, b_k, a_v, b_v, key_mask, lengths=None):
    B, h, d = a_k.shape[0], a_k.shape[-1], b_k.shape[-1]
    return q_b.new_empty(B, h, d)


@register_flop_formula(torch.ops.t6.tpa_decode)
def _(q_a, q_b, a_k, b_k, a_v, b_v, key_mask, lengths=None, out_shape=None) -> int:
    """Multiply-adds x 2 (shapes in): B_K . B_Q then A_Q (or B_K . q per head), and P A_V B_V; over all
    S cached tokens (with lengths, an upper bound)."""
    B, S, R_K, h = a_k
    d, R_V = b_k[-1], a_v[2]
    scores = 2 * B * S * R_K * d * h if q_a is None else 2 * B * S * R_K * q_a[1] * (d + h)
    return scores + 2 * B * S * R_V * h * d


def reference_tpa_decode(q_a, q_b, a_k, b_k, a_v, b_v, key_mask, lengths=None) -> torch.Tensor:
    """The eager form of `tpa_decode` (same arguments and result): whole-context intermediates."""
    if lengths is not None:
        n, key_mask = within_lengths(lengths, key_mask, a_k.shape[1])
        a_k, b_k, a_v, b_v = a_k[:, :n], b_k[:, :n], a_v[:, :n], b_v[:, :n]  # [B, n, R, *]
    B, S, R_K, h = a_k.shape
    d, R_V = b_k.shape[-1], a_v.shape[2]
    b_k_flat = b_k.reshape(B, S * R_K, d)  # [B, S R_K, d_h]
    qb = torch.bmm(b_k_flat, q_b.transpose(1, 2))  # [B, S R_K, R_Q] (factorized) or [B, S R_K, h] (full query)
    if q_a is not None:
        qb = torch.bmm(qb, q_a)  # fold in the query's head factor: [B, S R_K, h]
    scores = (qb.view(B, S, R_K, h).float() * a_k.float()).sum(dim=2)  # [B, S, h]
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[..., None], float("-inf"))  # [B, S, h]
    probs = scores.softmax(dim=1)  # over the cached tokens: [B, S, h]
    w = (probs[:, :, None] * a_v.float()).reshape(B, S * R_V, h)  # P[s, i] A_V[s, r, i]: [B, S R_V, h]
    y = torch.bmm(w.transpose(1, 2), b_v.float().reshape(B, S * R_V, d))  # [B, h, d_h]
    return (y / R_V).to(q_b.dtype)


@torch.library.custom_op("t6::latent_decode", mutates_args=())
def latent_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    c_kv: torch.Tensor,
    k_rope: torch.Tensor,
    key_mask: torch.Tensor | None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA's absorbed decoding: one new query per row, every head against the one shared latent.

    q_lat [B, h, d_c] (q_nope W_UK, scaled), q_rope [B, h, d_rope] (rotated, scaled),
    c_kv [B, S, d_c], k_rope [B, S, d_rope], key_mask None or bool [B, S], lengths None or int [B].
    Returns the attention-weighted latents [B, h, d_c] (W_UV is applied by the caller).
    """
    check_lengths(lengths, c_kv.shape[0])
    if triton_interpreted():
        return triton_or_reference("latent_decode", q_lat, q_rope, c_kv, k_rope, key_mask, lengths)
    if lengths is not None:
        n, key_mask = within_lengths(lengths, key_mask, c_kv.shape[1])
        c_kv, k_rope = c_kv[:, :n], k_rope[:, :n]  # [B, n, d_c], [B, n, d_rope]
    ext = cpu_extension() if q_lat.device.type == "cpu" else None
    if ext is None:
        return reference_latent_decode(q_lat, q_rope, c_kv, k_rope, key_mask)
    return ext.latent_decode(q_lat, q_rope, c_kv, k_rope, key_mask)


@latent_decode.register_fake
def _(q_lat, q_rope, c_kv, k_rope, key_mask, lengths=None):
    return q_lat.new_empty(q_lat.shape)


@register_flop_formula(torch.ops.t6.latent_decode)
def _(q_lat, q_rope, c_kv, k_rope, key_mask, lengths=None, out_shape=None) -> int:
    """Multiply-adds x 2 (shapes in): scores over the latent and the RoPE key, then P c_kv; over all S
    cached tokens (with lengths, an upper bound)."""
    B, h, d_c = q_lat
    S, d_rope = c_kv[1], k_rope[-1]
    return 2 * B * h * S * (d_c + d_rope) + 2 * B * h * S * d_c


def reference_latent_decode(q_lat, q_rope, c_kv, k_rope, key_mask, lengths=None) -> torch.Tensor:
    """The eager form of `latent_decode` (same arguments and result)."""
    if lengths is not None:
        n, key_mask = within_lengths(lengths, key_mask, c_kv.shape[1])
        c_kv, k_rope = c_kv[:, :n], k_rope[:, :n]  # [B, n, d_c], [B, n, d_rope]
    scores = torch.bmm(q_lat, c_kv.transpose(1, 2)) + torch.bmm(q_rope, k_rope.transpose(1, 2))  # [B, h, S]
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None], float("-inf"))  # [B, h, S]
    probs = scores.float().softmax(dim=-1).to(c_kv.dtype)  # [B, h, S]
    return torch.bmm(probs, c_kv).to(q_lat.dtype)  # [B, h, d_c]


@torch.library.custom_op("t6::gqa_decode", mutates_args=())
def gqa_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_rope: torch.Tensor | None,
    k_rope: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of one new query per row over cached K/V heads, each K/V head read once for the query
    heads of its group: MHA (one query head per K/V head), GQA, MQA, and GTA (its keys' shared RoPE part).

    q [B, h, d_k] (scaled); k [B, h_kv, S, d_k] and v [B, h_kv, S, d_v]: head-major cache views (views up to the
    new token included, or whole caches bounded by lengths), each token's row contiguous; h divisible by h_kv,
    query head i reads K/V head i // (h / h_kv). q_rope [B, h, d_rope] (scaled) and k_rope [B, S, d_rope]: a part
    of every key shared by all heads, whose score q_rope[i] . k_rope[s] adds to q[i] . k[s] (GTA), or both None.
    key_mask: None or bool [B, S], False where the query must not look (padding). lengths: None or int [B]:
    row b attends to its first lengths[b] cached tokens only. Returns [B, h, d_v].
    """
    check_lengths(lengths, k.shape[0])
    check_groups(q, k, v, q_rope, k_rope)
    if triton_interpreted():
        return triton_or_reference("gqa_decode", q, k, v, q_rope, k_rope, key_mask, lengths)
    if lengths is not None:
        n, key_mask = within_lengths(lengths, key_mask, k.shape[2])
        k, v = k[:, :, :n], v[:, :, :n]  # [B, h_kv, n, d]
        k_rope = None if k_rope is None else k_rope[:, :n]  # [B, n, d_rope]
    ext = cpu_extension() if q.device.type == "cpu" else None
    if ext is None:
        return reference_gqa_decode(q, k, v, q_rope, k_rope, key_mask)
    return ext.gqa_decode(q, k, v, q_rope, k_rope, key_mask)


def check_groups(q, k, v, q_rope, k_rope) -> None:
    problems = []
    if q.shape[1] % k.shape[1]:
        problems.append(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")
    if k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        problems.append(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit [B, h, d_k], "
            "[B, h_kv, S, d_k], [B, h_kv, S, d_v]"
        )
    if (q_rope is None) != (k_rope is None):
        problems.append("q_rope and k_rope come together (a key part shared by every head) or not at all")
    if problems:
        raise ValueError("gqa_decode: " + "; ".join(problems))


@gqa_decode.register_fake
def _(q, k, v, q_rope, k_rope, key_mask, lengths=None):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


@register_flop_formula(torch.ops.t6.gqa_decode)
def _(q, k, v, q_rope, k_rope, key_mask, lengths=None, out_shape=None) -> int:
    """Multiply-adds x 2 (shapes in): every head's scores (and the shared RoPE part's), then P v; over all S cached
    tokens (with lengths, an upper bound)."""
    B, h, d_k = q
    S, d_v = k[2], v[-1]
    d_rope = 0 if q_rope is None else q_rope[-1]
    return 2 * B * h * S * (d_k + d_rope) + 2 * B * h * S * d_v


def reference_gqa_decode(q, k, v, q_rope, k_rope, key_mask, lengths=None) -> torch.Tensor:
    """The eager form of `gqa_decode` (same arguments and result)."""
    if lengths is not None:
        n, key_mask = within_lengths(lengths, key_mask, k.shape[2])
        k, v = k[:, :, :n], v[:, :, :n]  # [B, h_kv, n, d]
        k_rope = None if k_rope is None else k_rope[:, :n]  # [B, n, d_rope]
    B, h, d = q.shape
    h_kv = k.shape[1]
    scores = torch.matmul(q.reshape(B, h_kv, h // h_kv, d), k.transpose(2, 3))  # [B, h_kv, g, S]
    if q_rope is not None:
        scores = scores + torch.bmm(q_rope, k_rope.transpose(1, 2)).view(scores.shape)  # + shared part: [B, h_kv, g, S]
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None], float("-inf"))  # [B, h_kv, g, S]
    probs = scores.float().softmax(dim=-1).to(v.dtype)  # [B, h_kv, g, S]
    return torch.matmul(probs, v).reshape(B, h, v.shape[-1]).to(q.dtype)  # [B, h, d_v]


@functools.cache
def _kernels():
    """The Triton kernels' module (imported on the first CUDA call: triton's import stays off CPU-only runs)."""
    from t6.model.attention import triton_decode

    return triton_decode


def _on(device: torch.device):
    """A Triton launch runs on the current CUDA device, not the tensors' (triton.runtime.jit): the tensors'
    device made current where it is not, so a model on cuda:1 decodes on cuda:1."""
    return contextlib.nullcontext() if device.index == torch.cuda.current_device() else torch.cuda.device(device)


REFERENCES = {
    "tpa_decode": reference_tpa_decode,
    "latent_decode": reference_latent_decode,
    "gqa_decode": reference_gqa_decode,
}


def triton_interpreted() -> bool:
    """Whether Triton runs on the CPU here (its interpreter, TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def implementation(device: torch.device | str) -> str:
    """What runs the fused operators on `device` in this process: "Triton" (CUDA, or Triton's interpreter), "C++"
    (the CPU's compiled kernels) or "eager reference" (where those could not be built, or the Triton kernels fell
    back)."""
    if torch.device(device).type == "cuda" or triton_interpreted():
        return "Triton" if enabled("triton_decode") else "eager reference"
    return "C++" if cpu_extension() is not None else "eager reference"


def triton_or_reference(name: str, *args) -> torch.Tensor:
    """Operator `name` ("tpa_decode", "latent_decode", "gqa_decode") through its Triton kernel, on the tensors'
    device; where the kernel fails (t6.model.fallback "triton_decode": out of shared memory or registers at its
    first launch, a compiler error), and from then on, through the eager reference."""
    if enabled("triton_decode"):
        device = args[1].device  # q_b, q_rope or k: never None
        try:
            with _on(device) if device.type == "cuda" else contextlib.nullcontext():
                return getattr(_kernels(), name)(*args)
        except Exception as err:
            fell_back("triton_decode", err)
    return REFERENCES[name](*args)


@tpa_decode.register_kernel("cuda")
def _(q_a, q_b, a_k, b_k, a_v, b_v, key_mask, lengths=None):
    check_lengths(lengths, a_k.shape[0])
    return triton_or_reference("tpa_decode", q_a, q_b, a_k, b_k, a_v, b_v, key_mask, lengths)


@latent_decode.register_kernel("cuda")
def _(q_lat, q_rope, c_kv, k_rope, key_mask, lengths=None):
    check_lengths(lengths, c_kv.shape[0])
    return triton_or_reference("latent_decode", q_lat, q_rope, c_kv, k_rope, key_mask, lengths)


@gqa_decode.register_kernel("cuda")
def _(q, k, v, q_rope, k_rope, key_mask, lengths=None):
    check_lengths(lengths, k.shape[0])
    check_groups(q, k, v, q_rope, k_rope)
    return triton_or_reference("gqa_decode", q, k, v, q_rope, k_rope, key_mask, lengths)
