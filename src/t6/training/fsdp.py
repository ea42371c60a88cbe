"""Fully sharded data parallel (conf/trainer/fsdp.yaml) and the gradient norm of any wrapping.

- `T6FSDPStrategy`: Lightning's FSDPStrategy, one FSDP unit per transformer block, mixed precision as DDP's.
- `clip_grad_norm()`: the global gradient norm (and clipping) of a plain, DDP or FSDP model.
- `full_model()`: an unwrapped copy of an FSDP-sharded T6 with every parameter whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateKeyType,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from t6.errors import SettingError


def full_state_dict_context(model: FSDP, rank0_only: bool):
    """FSDP's full (gathered) state-dict mode. Offloading to CPU only where the parameters are not
    there already: torch's FSDP offloading CPU tensors to CPU frees storage the copies still use."""
    offload = model.compute_device.type != "cpu"
    return FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
        FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
    )


class MixedPrecisionLikeDDP(FSDPPrecision):
    """Lightning's FSDP precision with DDP's numerics under `bf16-mixed` / `16-mixed`: the parameters stay fp32
    (FSDP gathers them, the backward reduces their gradients and the optimizer updates them in fp32: no FSDP
    MixedPrecision) and autocast runs the matmuls in bf16/fp16 on the parameters' device, as DDP's mixed
    precision does. Lightning's own casts the gathered parameters to bf16 for the whole forward and backward
    (norms, softmax and the loss then compute from bf16 weights) and autocasts CUDA only. The cost: the
    all-gathers move fp32, twice the bytes of bf16. `*-true` precisions are Lightning's."""

    def __init__(self, precision, scaler=None):
        super().__init__(precision, scaler)
        self.device_type = "cuda"  # the strategy sets the parameters' device type at setup

    @property
    def mixed_precision_config(self) -> MixedPrecision:
        if "mixed" in self.precision:  # fp32 throughout: FSDP makes no low-precision copies
            return MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
        return super().mixed_precision_config

    def forward_context(self):
        if "mixed" in self.precision:
            dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
            return torch.autocast(self.device_type, dtype=dtype)
        return super().forward_context()


class T6FSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy with four changes.

    - Runs on CPU with gloo as well as on CUDA: Lightning refuses `accelerator=cpu` only for the
      exact FSDPStrategy type, and torch's FSDP needs `device_id=cpu` said explicitly (the tests
      exercise sharding, clipping, gathering and resume on CPU this way).
    - Mixed precision computes as DDP's does (`MixedPrecisionLikeDDP`): fp32 parameters, gradients and
      reductions, bf16/fp16 matmuls by autocast.
    - Full state dicts are gathered without CPU offload where the parameters live on the CPU
      (`full_state_dict_context`).
    - Resuming from a full, single-file checkpoint reads it with `torch.load(weights_only=True,
      mmap=True)` (Lightning's own loader unpickles it in full): no pickled code runs, and each rank
      maps the file rather than copying it into RAM. Sharded checkpoint directories
      (state_dict_type: sharded) go through Lightning's loader.

    Each transformer block is one FSDP unit (`auto_wrap_policy`), and with activation_checkpointing=True
    also one checkpointed unit; parameter names survive wrapping (use_orig_params: per-block compile, logging).
    """

    def __init__(self, activation_checkpointing: bool = False, state_dict_type: str = "full", **kwargs):
        from t6.model.t6 import Block

        if activation_checkpointing:
            kwargs["activation_checkpointing_policy"] = {Block}
        kwargs.setdefault("use_orig_params", True)
        kwargs.setdefault("auto_wrap_policy", {Block})
        super().__init__(state_dict_type=state_dict_type, **kwargs)
        self.full_state = state_dict_type == "full"
        self.checkpointed = (Block,) if activation_checkpointing else ()

    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Lightning's, with `device_id=cpu` on the CPU (Lightning passes the device's index, None there, and
        torch's FSDP then looks for an accelerator); no public hook wraps the model otherwise."""
        if self.root_device.type != "cpu" or any(isinstance(m, FSDP) for m in model.modules()):
            return super()._setup_model(model)
        model = FSDP(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        if self.checkpointed:  # each block recomputed in backward, as Lightning does on a GPU
            from torch.utils.checkpoint import checkpoint

            for module in model.modules():
                if isinstance(module, self.checkpointed):
                    module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
        return model

    @property
    def precision_plugin(self) -> FSDPPrecision:
        return FSDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if type(plugin) is FSDPPrecision:  # the one Lightning's connector makes from trainer.precision
            plugin = MixedPrecisionLikeDDP(plugin.precision, plugin.scaler)
        FSDPStrategy.precision_plugin.fset(self, plugin)

    def setup_environment(self) -> None:
        super().setup_environment()
        if isinstance(self.precision_plugin, MixedPrecisionLikeDDP):
            self.precision_plugin.device_type = self.root_device.type

    def lightning_module_state_dict(self) -> dict:
        if not self.full_state:
            return super().lightning_module_state_dict()
        with full_state_dict_context(self.model, rank0_only=True):
            return self.model.state_dict()

    def optimizer_state(self, optimizer) -> dict:
        if not self.full_state:
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):  # Lightning's wrapper: the torch optimizer it holds
            optimizer = optimizer.optimizer
        with full_state_dict_context(self.model, rank0_only=True):
            state = FSDP.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:  # keyed by parameter index in the optimizer's order, as a plain run saves it
                state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model, optim=optimizer)
            return state

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        path = Path(self.broadcast(checkpoint_path))
        if not path.is_file():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        module = self.lightning_module
        with full_state_dict_context(self.model, rank0_only=False):
            self.model.load_state_dict(checkpoint.pop("state_dict"), strict=module.strict_loading)
        states = checkpoint.get("optimizer_states")
        if states is None or module.trainer.state.fn != TrainerFn.FITTING:
            return checkpoint
        if len(self.optimizers) != len(states):
            raise SettingError(
                f"{path} holds {len(states)} optimizer states; this run has {len(self.optimizers)} optimizers"
            )
        with full_state_dict_context(self.model, rank0_only=False):
            for optimizer, state in zip(self.optimizers, states):
                if state["state"] and isinstance(next(iter(state["state"])), int):  # saved by a plain (non-FSDP) run
                    state = FSDP.rekey_optim_state_dict(
                        state, OptimStateKeyType.PARAM_NAME, self.model, optim=optimizer
                    )  # its indices follow the optimizer's parameter groups, not model.parameters()
                optimizer.load_state_dict(
                    FSDP.optim_state_dict_to_load(model=self.model, optim=optimizer, optim_state_dict=state)
                )
        return checkpoint


def clip_grad_norm(wrapped: nn.Module, module: nn.Module, max_norm: float | None) -> torch.Tensor:
    """The global L2 norm of the gradients before clipping (a 0-dim tensor; no host sync), clipping
    them in place to max_norm when given. `wrapped` is the strategy's model (an FSDP root, DDP, or
    `module` itself). Under DDP the gradients are already all-reduced, so the local norm is global;
    under FSDP each rank holds a shard and FSDP's clip_grad_norm_ all-reduces the squared norms."""
    if isinstance(wrapped, FSDP):
        return wrapped.clip_grad_norm_(max_norm if max_norm else float("inf"))
    params = [p for p in module.parameters() if p.grad is not None]
    if not params:
        return torch.zeros((), device=next(module.parameters()).device)  # where the agreement all-reduces it
    if max_norm:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return torch.nn.utils.get_total_norm([p.grad for p in params])


def full_model(wrapped: FSDP, model_factory: Callable[[], nn.Module]) -> nn.Module:
    """`model_factory()` (built on CPU) with the FSDP root `wrapped`'s full state dict loaded,
    on `wrapped`'s device. A collective: every rank calls it and gets its own whole copy. The
    LightningModule's keys are `model.`-prefixed; the copy gets those under that prefix."""
    with full_state_dict_context(wrapped, rank0_only=False):
        state = wrapped.state_dict()
    model = model_factory()
    model.load_state_dict({k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")})
    return model.to(wrapped.compute_device)
