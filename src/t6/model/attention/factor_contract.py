"""TPA's contraction of Q, K or V from their factors as PyTorch custom operators (torch.library): `t6::tpa_contract`
and its backward `t6::tpa_contract_backward`, with fake (meta) implementations, so torch.compile takes them as they
are, and an autograd formula joining them.

    tpa_contract(a [..., R, h], b [..., R, d_h]) -> (1/R) sum_r a[..., r, :, None] b[..., r, None, :]   [..., h, d_h]

On CUDA they run the Triton kernels of `t6.model.attention.triton_contract` (one pass each way: the backward
reads the gradient once for both factors); elsewhere, and where a kernel fails (t6.model.fallback
"triton_contract": at its first launch, then for the rest of the process), the eager reference (einsum).
TPA's training step calls them where `TensorProductAttention.triton_contract` is on (docs/performance.md, "TPA's
training path", says when).
"""

from __future__ import annotations

import contextlib

import torch

from t6.model.fallback import enabled, fell_back


def reference_contract(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(1/R) A^T B per token: a [..., R, h], b [..., R, d_h] -> [..., h, d_h]."""
    return torch.einsum("...rh,...rd->...hd", a, b) / a.shape[-2]  # [..., h, d_h]


def reference_contract_backward(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of reference_contract at (a, b) for grad [..., h, d_h] -> (da [..., R, h], db [..., R, d_h])."""
    R = a.shape[-2]
    da = torch.einsum("...hd,...rd->...rh", grad, b) / R  # [..., R, h]
    db = torch.einsum("...hd,...rh->...rd", grad, a) / R  # [..., R, d_h]
    return da, db


@torch.library.custom_op("t6::tpa_contract", mutates_args=())
def tpa_contract(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return reference_contract(a, b)


@tpa_contract.register_fake
def _(a, b):
    return a.new_empty(*a.shape[:-2], a.shape[-1], b.shape[-1])  # [..., h, d_h]


@torch.library.custom_op("t6::tpa_contract_backward", mutates_args=())
def tpa_contract_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference_contract_backward(grad, a, b)


@tpa_contract_backward.register_fake
def _(grad, a, b):
    return torch.empty_like(a), torch.empty_like(b)


def setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def contract_backward(ctx, grad):
    a, b = ctx.saved_tensors
    return tpa_contract_backward(grad, a, b)


tpa_contract.register_autograd(contract_backward, setup_context=setup_context)


def triton_or_reference(name: str, *args) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`forward` or `backward` of the Triton kernels on the tensors' device; where a kernel fails, and from then on,
    the eager reference."""
    if enabled("triton_contract"):
        device = args[0].device
        try:
            current = device.type == "cuda" and device.index != torch.cuda.current_device()
            with torch.cuda.device(device) if current else contextlib.nullcontext():  # Triton launches there
                from t6.model.attention import triton_contract

                return getattr(triton_contract, name)(*args)
        except Exception as err:
            fell_back("triton_contract", err)
    return {"forward": reference_contract, "backward": reference_contract_backward}[name](*args)


@tpa_contract.register_kernel("cuda")
def _(a, b):
    return triton_or_reference("forward", a, b)


@tpa_contract_backward.register_kernel("cuda")
def _(grad, a, b):
    return triton_or_reference("backward", grad, a, b)
