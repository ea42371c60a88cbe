"""The peak memory of one training step on one device, and the micro-batch that fits.

- `estimate_step_memory`: from the model traced on fake (meta) tensors: parameters, gradients,
  optimizer state, the tensors autograd saves for backward (measured per block by a trace, not
  guessed), the logits of the loss (one chunk of `loss_chunk_tokens` tokens x vocab at a time,
  t6.model.loss; all tokens when None; Liger's own chunk when the loss runs as its kernel), and
  the optimizer step's temporaries; FSDP shards parameters, gradients and optimizer state; DDP
  adds its all-reduce buckets unless the gradients are views into them; activation
  checkpointing keeps only each block's input plus one block being recomputed.
- `fit_micro_batch`: the largest micro-batch that fits and divides the per-device share of the
  global batch (the global batch, hence the optimization, is unchanged: the rest is gradient
  accumulation), or a `MemoryError` naming the field, the estimate, the memory and the ways out.

On CPU an out-of-memory is a SIGKILL with no message, so the estimate has to decide; on GPU
it decides too. What the device can give comes from `t6.hardware.probes.available_memory`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from t6.errors import NoRoom
from t6.hardware.device import compute_dtype, param_dtype
from t6.hardware.probes import gib
from t6.model.loss import liger_chunk_rows

MARGIN = (
    0.20  # keep this share of the available memory free: the estimate ran up to 17% under the measured peak (README)
)


@dataclass
class StepMemory:
    """Bytes per device of one training step at micro-batch `batch` (`total` is the estimated peak)."""

    batch: int
    params: int
    grads: int
    optimizer: int
    activations: int  # saved for backward, the whole forward
    loss_transient: int  # the logits (and their gradient) alive at once in the loss
    step_transient: int  # the optimizer step's temporaries
    head_grad: int  # the tied embedding/head gradient, the first one backward writes
    accumulate: int = 1  # with accumulation every gradient is alive during backward
    runtime: int = 0  # the process itself (CPU: its resident size before training)
    buckets: int = 0  # DDP's all-reduce buckets, a second copy of the gradients (unless they are views into them)
    loss_bytes_per_token: int = 0  # loss_transient per row of logits alive at once ...
    loss_chunk_tokens: int | None = None  # ... which is at most this many tokens (None: every token)
    seq_len: int = 0
    loss_rows: Callable[[int], int] | None = None  # ... or, when given, this function of the tokens (Liger)
    notes: list[str] = field(default_factory=list)

    @property
    def first_grads(self) -> int:
        return self.grads if self.accumulate > 1 else self.head_grad

    @property
    def backward_peak(self) -> int:
        return self.activations + self.loss_transient + self.first_grads

    @property
    def step_peak(self) -> int:
        return self.grads + self.step_transient

    @property
    def total(self) -> int:
        return self.runtime + self.params + self.optimizer + self.buckets + max(self.backward_peak, self.step_peak)

    def loss_at(self, batch: int) -> int:
        """loss_transient at another micro-batch: linear in the tokens up to one chunk."""
        tokens = batch * self.seq_len
        if self.loss_rows is not None:
            return self.loss_bytes_per_token * self.loss_rows(tokens)
        return self.loss_bytes_per_token * (
            tokens if self.loss_chunk_tokens is None else min(tokens, self.loss_chunk_tokens)
        )

    def describe(self) -> str:
        parts = [
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("loss", self.loss_transient),
        ]
        if self.buckets:
            parts.append(("DDP buckets", self.buckets))
        if self.runtime:
            parts.append(("process", self.runtime))
        inner = ", ".join(f"{name} {gib(value)}" for name, value in parts)
        return f"{gib(self.total)} at micro-batch {self.batch} ({inner})"


def optimizer_state_bytes(model: torch.nn.Module, optimizer_target: str, dtype_bytes: int) -> tuple[int, int]:
    """(state bytes, largest per-tensor temporary) for the optimizer class named by its `_target_`."""
    from t6.training.optim import param_groups

    name = optimizer_target.rsplit(".", 1)[-1].lower()
    total, largest = 0, 0
    for group in param_groups(model, 0.0):
        for p in group["params"]:
            n = p.numel() * dtype_bytes
            largest = max(largest, n)
            if name in ("adamw", "adam"):
                total += 2 * n  # exp_avg, exp_avg_sq
            elif name == "muonwithadamw":
                total += n if group["kind"] == "matrix" else 2 * n  # momentum | AdamW's two moments
            elif name == "adafactor":
                total += (sum(p.shape[-2:]) * dtype_bytes) if p.ndim >= 2 else n  # factored rows + cols
            elif name == "sgd":
                total += n  # momentum buffer
            else:
                total += 2 * n  # unknown: assume two moments
    return total, largest


def trace_saved_tensors(
    model: torch.nn.Module,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    mixed: bool,
    loss_chunk_tokens: int | None = None,
):
    """Run one forward + loss (as training computes it) on fake tensors; returns (bytes saved for backward outside the
    blocks, per-block saved bytes, bytes of one block's input). Parameters are not counted
    (they are `params`); casts of them under autocast are (they are new tensors)."""
    from t6.model.t6 import Block

    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: set[int] = set()
    current: list[int | None] = [None]
    per_block: dict[int, int] = {}
    outside = [0]
    block_input = [0]

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in seen and key not in param_storages:
            seen.add(key)
            n = storage.nbytes()
            if current[0] is None:
                outside[0] += n
            else:
                per_block[current[0]] = per_block.get(current[0], 0) + n
        return t

    blocks = [m for m in model.modules() if isinstance(m, Block)]
    handles = []
    for i, block in enumerate(blocks):

        def pre(module, args, i=i):
            current[0] = i
            block_input[0] = args[0].numel() * args[0].element_size()

        def post(module, args, out):
            current[0] = None

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    try:
        idx = torch.zeros(batch, seq_len, dtype=torch.long)
        target = torch.zeros(batch, seq_len, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=dtype, enabled=mixed):
                model(idx, targets=target, loss_chunk_tokens=loss_chunk_tokens)  # [] (t6.model.loss)
    finally:
        for h in handles:
            h.remove()
    return outside[0], [per_block.get(i, 0) for i in range(len(blocks))], block_input[0]


def estimate_step_memory(
    model_cfg,
    batch: int,
    seq_len: int,
    precision: str = "32-true",
    optimizer_target: str = "torch.optim.AdamW",
    shards: int = 1,
    activation_checkpointing: bool = False,
    accumulate: int = 1,
    device: str = "cpu",
    runtime: int = 0,
    loss_chunk_tokens: int | None = None,
    liger: bool = False,
    ddp_buckets: bool = False,
) -> StepMemory:
    """Peak bytes of one training step per device (see the module docstring). liger: the loss runs as
    Liger's fused kernel (loss_impl, CUDA), which sizes its own chunks (loss_chunk_tokens is not used).
    ddp_buckets: DDP keeps its all-reduce buckets beside the gradients (gradient_as_bucket_view off)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from t6.model import T6

    pdtype, cdtype = param_dtype(precision), compute_dtype(precision)
    mixed = str(precision).endswith("-mixed")
    pbytes = torch.tensor([], dtype=pdtype).element_size()
    loss_rows = None
    if liger:  # it saves what the chunked path saves (dh [N, d] and dW [V, d]); trace that at Liger's chunk
        loss_rows = partial(liger_chunk_rows, vocab=model_cfg.vocab_size, d=model_cfg.d_model)
        loss_chunk_tokens = loss_rows(batch * seq_len)
    with FakeTensorMode(allow_non_fake_inputs=True):
        default = torch.get_default_dtype()
        torch.set_default_dtype(pdtype)  # parameters created in their storage dtype
        try:
            with torch.device("cpu"):
                model = T6(model_cfg)
        finally:
            torch.set_default_dtype(default)
        n_params = sum(p.numel() for p in model.parameters())
        opt_state, largest = optimizer_state_bytes(model, optimizer_target, pbytes)
        outside, blocks, block_in = trace_saved_tensors(model, batch, seq_len, cdtype, mixed, loss_chunk_tokens)
    params = n_params * pbytes
    if activation_checkpointing and blocks:
        activations = outside + len(blocks) * block_in + max(blocks)  # inputs kept, one block recomputed
    else:
        activations = outside + sum(blocks)
    tokens = batch * seq_len
    cbytes = torch.tensor([], dtype=cdtype).element_size()
    if liger:
        # one chunk's logits in the matmul dtype, turned into their gradient in place
        per_token = model_cfg.vocab_size * cbytes
        loss_transient = loss_rows(tokens) * per_token
    elif loss_chunk_tokens is None:
        # nll_loss's and log_softmax's gradients ([tokens, vocab] fp32), plus the cast back when the logits are not fp32
        per_token = model_cfg.vocab_size * (4 + 4 + (cbytes if cbytes != 4 else 0))
        loss_transient = tokens * per_token
    else:
        # one chunk's fp32 logits, turned into their gradient in place, plus its cast when the matmuls are not fp32
        # (the gradients the chunks accumulate, [tokens, d] and [vocab, d], are saved tensors: in `outside`)
        per_token = model_cfg.vocab_size * (4 + (cbytes if cbytes != 4 else 0))
        loss_transient = min(tokens, loss_chunk_tokens) * per_token
    embedding = model_cfg.vocab_size * model_cfg.d_model * pbytes  # the tied head's gradient comes first
    grads = params // shards
    if device == "cuda":
        step_transient = params // shards  # foreach updates: one parameter-sized list of temporaries
    else:
        step_transient = 2 * largest // shards  # per-tensor updates: temporaries of the largest tensor
    notes = []
    if shards > 1:
        notes.append(f"FSDP: parameters, gradients and optimizer state sharded {shards} ways")
    if activation_checkpointing:
        notes.append("activation checkpointing: block inputs kept, one block recomputed")
    if ddp_buckets:
        notes.append(
            "DDP: all-reduce buckets beside the gradients (trainer.strategy.gradient_as_bucket_view=true saves them)"
        )
    return StepMemory(
        batch=batch,
        params=params // shards,
        grads=grads,
        optimizer=opt_state // shards,
        activations=activations,
        loss_transient=loss_transient,
        step_transient=step_transient,
        head_grad=embedding // shards,
        accumulate=accumulate,
        runtime=runtime,
        buckets=grads if ddp_buckets else 0,
        loss_bytes_per_token=per_token,
        loss_chunk_tokens=loss_chunk_tokens,
        seq_len=seq_len,
        loss_rows=loss_rows,
        notes=notes,
    )


@dataclass
class MicroBatch:
    batch: int
    accumulate: int
    estimate: StepMemory
    available: int
    source: str
    auto: bool

    def describe(self) -> str:
        how = "data.batch_size=auto chose" if self.auto else "data.batch_size"
        return (
            f"{how} micro-batch {self.batch} x {self.accumulate} accumulation step(s); peak estimate "
            f"{self.estimate.describe()}; usable {gib(self.available * (1 - MARGIN))} ({self.source})"
        )


def divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def fit_micro_batch(
    estimate: Callable[[int], StepMemory],
    requested,
    per_device: int,
    available: int,
    source: str,
    ways_out: str,
    margin: float = MARGIN,
) -> MicroBatch:
    """requested: an int micro-batch (checked) or "auto" (the largest divisor of per_device that fits).
    estimate(batch) -> StepMemory. Activations grow linearly with the batch, so two
    traces (batch 1 and 2) give every other batch size."""
    usable = int(available * (1 - margin))
    one, two = estimate(1), estimate(2)
    slope = two.activations - one.activations

    def at(b: int, accumulate: int) -> StepMemory:
        return replace(
            one,
            batch=b,
            accumulate=accumulate,
            activations=one.activations + (b - 1) * slope,
            loss_transient=one.loss_at(b),
        )

    if requested == "auto":
        for b in divisors_desc(per_device):
            acc = per_device // b
            est = at(b, acc)
            if est.total <= usable:
                return MicroBatch(b, acc, est, available, source, auto=True)
        est = at(1, per_device)
        raise NoRoom(
            f"data.batch_size=auto: even a micro-batch of 1 needs {est.describe()}, more than the "
            f"{gib(usable)} usable ({source}, {int(margin * 100)}% kept free). Ways out: {ways_out}"
        )
    b = int(requested)
    acc = max(1, per_device // b)
    est = at(b, acc)
    if est.total > usable:
        fits = next((d for d in divisors_desc(per_device) if at(d, per_device // d).total <= usable), None)
        hint = f"data.batch_size={fits} (or auto) fits" if fits else "no micro-batch of this model fits"
        raise NoRoom(
            f"data.batch_size={b} does not fit: one training step needs {est.describe()}, more than the "
            f"{gib(usable)} usable ({source}, {int(margin * 100)}% kept free); {hint}. Ways out: {ways_out}"
        )
    return MicroBatch(b, acc, est, available, source, auto=False)
