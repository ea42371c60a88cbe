"""Next-token cross-entropy of the tied LM head, computed in chunks of tokens.

    loss = mean_i [ logsumexp_v (h_i · W_v) - h_i · W_{y_i} ]      over the N tokens with y_i != ignore

The plain path forms all logits z = h Wᵀ [N, V] (and their gradient, the same size) at once: at
V = 50,304 that is 200 KB per token in fp32, most of a small model's step memory. Here the
tokens go through in chunks of `chunk_tokens`: each chunk's logits exist only inside the loop,
and since dloss/dz = (softmax(z) - onehot(y)) / N is known as soon as z is, the gradients with
respect to h and W are accumulated in the same pass (no recomputation in backward):

    dh_chunk = dz_chunk W          [n, d]
    dW      += dz_chunkᵀ h_chunk   [V, d]

Peak extra memory is one chunk's logits [n, V] in fp32 plus dW [V, d] (which the plain path
also builds), instead of [N, V] twice. The chunks share one logits buffer per call: a fresh
[n, V] tensor per chunk is a fresh ~200 MB mapping on CPU, whose page faults cost a share of
the step of their own. The result equals F.cross_entropy(h Wᵀ, y) to float
rounding (tests/test_loss.py checks loss and both gradients).

On CUDA the same computation runs by default as Liger-Kernel's fused linear cross-entropy
(`impl="auto"`): the same chunked algorithm with the softmax, its gradient and the loss in one
Triton pass over each chunk's logits (kept in the matmul dtype) instead of several elementwise
passes, and a chunk of ~N d / V rows chosen by Liger, so the logits it holds are about the size of
h. `impl="chunked"` keeps the path above on every device; `impl="liger"` asks for Liger anywhere
Triton runs (a CUDA GPU, or the CPU under TRITON_INTERPRET=1, how the tests check it). "auto" never
picks a Liger that is not installed, and where Liger fails at its first call the loss runs the chunked
path from then on (t6.model.fallback "liger").
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

from t6.errors import SettingError
from t6.model.fallback import enabled, fell_back

IGNORE_INDEX = -100  # as F.cross_entropy
IMPLS = ("auto", "chunked", "liger")  # see the module docstring


class _Buffers:
    """The [rows, V] tensors every chunk reuses: the logits in fp32 (or wider) and, when the matmuls
    run in a narrower dtype (bf16 under autocast), the matmul's output and dz's cast back in that dtype."""

    def __init__(self, rows: int, h: torch.Tensor, weight: torch.Tensor):
        shape = (rows, weight.shape[0])
        self.logits = torch.empty(shape, dtype=_acc_dtype(h), device=h.device)  # [rows, V]
        self.narrow = None if h.dtype == self.logits.dtype else torch.empty(shape, dtype=h.dtype, device=h.device)
        self.product = None  # [V, d] in the matmul dtype, for add_product

    def logits_of(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """h Wᵀ into the buffers: [n, V] at least fp32, a view of self.logits."""
        z = self.logits[: h.shape[0]]  # [n, V]
        if self.narrow is None:
            return torch.mm(h, weight.t(), out=z)
        return z.copy_(torch.mm(h, weight.t(), out=self.narrow[: h.shape[0]]))

    def add_product(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """out += a @ b, with no fresh [V, d] temporary per chunk (out is fp32 when a and b are bf16)."""
        if a.dtype == out.dtype:
            return out.addmm_(a, b)
        if self.product is None:
            self.product = torch.empty(out.shape, dtype=a.dtype, device=a.device)
        return out.add_(torch.mm(a, b, out=self.product))

    def narrowed(self, dz: torch.Tensor) -> torch.Tensor:
        """dz [n, V] cast to the matmul dtype (a view of self.narrow), or dz itself."""
        return dz if self.narrow is None else self.narrow[: dz.shape[0]].copy_(dz)


def _chunk_terms(
    h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, n_valid: torch.Tensor, need_grad: bool, buffers: _Buffers
):
    """One chunk: (sum of its token losses, dloss/dlogits or None). h [n, d], weight [V, d], y [n]."""
    z = buffers.logits_of(h, weight)  # [n, V] logits, at least fp32 for the softmax
    valid = y != IGNORE_INDEX  # [n]
    safe_y = torch.where(valid, y, 0)  # [n]
    target = z.gather(1, safe_y[:, None]).squeeze(1)  # [n]
    peak = z.amax(dim=-1, keepdim=True)  # [n, 1]
    p = z.sub_(peak).exp_()  # [n, V] exp(z - max), in z's own storage: one [n, V] tensor in all
    total = p.sum(dim=-1)  # [n]
    lse = peak.squeeze(1) + total.log()  # [n] logsumexp
    loss_sum = ((lse - target) * valid).sum()  # []
    if not need_grad:
        return loss_sum, None
    dz = p.div_(total[:, None])  # [n, V] softmax, in place
    dz[torch.arange(len(y), device=y.device), safe_y] -= 1.0  # softmax - onehot(y)
    dz *= (valid.to(dz.dtype) / n_valid)[:, None]  # [n, V] d(mean loss)/dz; ignored rows are zero
    return loss_sum, dz


def _count(y: torch.Tensor) -> torch.Tensor:
    """Targets that count, as a tensor (no host sync), at least one."""
    return (y != IGNORE_INDEX).sum().clamp(min=1)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # bf16/fp16 -> fp32; fp32 and fp64 stay


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        # h [N, d], weight [V, d], y [N] -> mean loss []
        n_valid = _count(y)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_grad = need_h or need_w
        dh = torch.empty_like(h) if need_h else None  # [N, d]
        dw = torch.zeros(weight.shape, dtype=_acc_dtype(weight), device=weight.device) if need_w else None  # [V, d]
        total = torch.zeros((), dtype=_acc_dtype(h), device=h.device)
        buffers = _Buffers(min(chunk_tokens, h.shape[0]), h, weight)
        for start in range(0, h.shape[0], chunk_tokens):
            hc, yc = h[start : start + chunk_tokens], y[start : start + chunk_tokens]  # [n, d], [n]
            loss_sum, dz = _chunk_terms(hc, weight, yc, n_valid, need_grad, buffers)
            total += loss_sum
            if dz is None:
                continue
            dz = buffers.narrowed(dz)  # [n, V] in the matmul dtype (bf16 under autocast)
            if need_h:
                torch.mm(dz, weight, out=dh[start : start + chunk_tokens])  # [n, d]
            if need_w:
                buffers.add_product(dw, dz.t(), hc)  # dw += dzᵀ h_chunk [V, d]
        del buffers
        ctx.save_for_backward(dh if need_h else None, dw.to(weight.dtype) if need_w else None)
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        dh, dw = ctx.saved_tensors
        return (
            None if dh is None else dh * grad_out.to(dh.dtype),
            None if dw is None else dw * grad_out.to(dw.dtype),
            None,
            None,
        )


def liger_installed() -> bool:
    """Whether Liger-Kernel can be imported here (the GPU image may lack it)."""
    return importlib.util.find_spec("liger_kernel") is not None


def use_liger(impl: str, device_type: str) -> bool:
    """Whether `impl` runs as Liger's kernel on this device type ("cpu", "cuda", ...): "auto" on CUDA where
    Liger is installed and has not failed (t6.model.fallback). An unknown impl, or "liger" where Triton cannot run
    or Liger is not installed, is an error naming the setting."""
    if impl not in IMPLS:
        raise SettingError(f"loss_impl={impl!r} must be one of {', '.join(IMPLS)}")
    triton_runs = device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if impl == "liger" and not triton_runs:
        raise SettingError(f"loss_impl=liger needs a CUDA device (here: {device_type}); use loss_impl=auto or chunked")
    if impl == "liger" and not liger_installed():
        raise SettingError(
            "loss_impl=liger needs Liger-Kernel, which is not installed here (pip install liger-kernel==0.8.5); "
            "use loss_impl=auto (Liger where it is installed, else the chunked loss) or chunked"
        )
    return impl == "liger" or (impl == "auto" and device_type == "cuda" and liger_installed() and enabled("liger"))


def liger_chunk_rows(tokens: int, vocab: int, d: int) -> int:
    """Rows of logits Liger's fused linear cross-entropy holds at once for `tokens` rows of h [tokens, d]:
    the next power of two of tokens / ceil(V / d), at most `tokens`, so about the size of h
    (liger_kernel.ops.fused_linear_cross_entropy, the pinned version; tests/test_loss.py checks it)."""
    shrink = -(-vocab // d)  # ceil(V / d)
    rows = -(-tokens // shrink)  # ceil(tokens / shrink)
    return min(tokens, 1 << (rows - 1).bit_length())  # rounded up to a power of two


def _liger(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Liger-Kernel's fused linear cross-entropy: h [N, d], weight [V, d], targets [N] -> mean loss [];
    the head's gradient accumulates in fp32 as in the chunked path."""
    try:  # a dependency of the project; the model's code in a Hugging Face export needs only torch
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as err:
        raise ImportError("loss_impl=liger needs liger-kernel (pip install liger-kernel==0.8.5)") from err

    return liger_fused_linear_cross_entropy(
        h, weight, targets, ignore_index=IGNORE_INDEX, reduction="mean", accum_dtype=torch.float32
    )


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int | None = 1024,
    impl: str = "auto",
) -> torch.Tensor:
    """Mean cross-entropy of logits h Wᵀ against targets. h [..., d], weight [V, d], targets [...]
    (IGNORE_INDEX = -100 skipped). impl picks the implementation: "auto" (Liger's fused kernel on CUDA,
    the chunked path elsewhere), "chunked" or "liger". The chunked path never holds more than
    chunk_tokens rows of logits; chunk_tokens=None makes it the plain F.cross_entropy over all logits
    at once (the reference). Liger sizes its own chunks."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)  # [N, d], [N]
    if chunk_tokens is not None and chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be a positive number of tokens or None")
    liger = use_liger(impl, h.device.type)
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):  # the matmuls in the autocast dtype, as nn.Linear would
        dtype = torch.get_autocast_dtype(device_type)
        h, weight = h.to(dtype), weight.to(dtype)
    with torch.autocast(device_type, enabled=False):
        if liger and enabled("liger"):
            try:
                return _liger(h, weight, targets)
            except Exception as err:  # computes nothing the chunked path needs: it starts afresh
                fell_back("liger", err)
        if chunk_tokens is None:
            return F.cross_entropy((h @ weight.t()).to(_acc_dtype(h)), targets, ignore_index=IGNORE_INDEX)
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            return _ChunkedLinearCrossEntropy.apply(h, weight, targets, chunk_tokens)
        n_valid = _count(targets)  # evaluation: the loss alone, chunk by chunk
        buffers = _Buffers(min(chunk_tokens, h.shape[0]), h, weight)
        chunks = zip(h.split(chunk_tokens), targets.split(chunk_tokens))
        return sum(_chunk_terms(hc, weight, yc, n_valid, False, buffers)[0] for hc, yc in chunks) / n_valid


@torch.no_grad()
def mean_loss(model, batches) -> float:
    """A model's mean next-token loss per token over batches of (input [B, T], target [B, T])."""
    model.eval()
    losses = [(model(x, targets=y).item(), y.numel()) for x, y in batches]  # (mean over the batch's B*T tokens, B*T)
    return sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
