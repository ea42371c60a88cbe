"""The private members of the libraries t6 builds on (Lightning, MLflow, PyTorch, lm-eval, transformers), all
in one table, each checked against the installed, pinned versions: an upgrade that renames or drops one fails
here, by name, instead of breaking a run silently. A private member used in src/t6 without a row here fails too.
Lightning's, where t6 reaches past its API from outside a subclass, are used through t6.training.lightning_private.

Behaviour that rests on them is tested where it lives: the agreed stop (tests/test_preemption.py,
tests/test_faults.py), the throughput's cadence (tests/test_train.py), checkpoints and last.ckpt
(tests/test_resume.py), FSDP (tests/test_distributed.py), the outbox logger (tests/test_tracking.py)."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

from conftest import ROOT

RICH = "lightning.pytorch.callbacks.progress.rich_progress:RichProgressBar"
EPOCH_LOOP = "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop"
CHECKPOINT = "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint"
TRAINER = "lightning.pytorch.trainer.trainer:Trainer"

# (owner: "module:Class" or "module", private name, where t6 uses it)
PRIVATE = [
    # Lightning: the agreed stop (t6.training.preemption)
    ("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector", "lightning_private.SignalConnector"),
    (TRAINER, "_signal_connector", "lightning_private.use_signal_connector, stop_at_this_step"),
    (EPOCH_LOOP, "_skip_next_val", "lightning_private.stop_at_this_step"),
    (EPOCH_LOOP, "_broadcast_sigterm_tensor", "lightning_private.use_signal_connector"),
    # Lightning: throughput measured once per logging step (t6.training.callbacks.throughput)
    ("lightning.pytorch.loops.fit_loop:_FitLoop", "_should_accumulate", "lightning_private.logs_at_this_batch"),
    (TRAINER, "_logger_connector", "lightning_private.logs_at_this_batch"),
    ("lightning.pytorch.callbacks.throughput_monitor:ThroughputMonitor", "_throughputs", "ThroughputMonitor"),
    ("lightning.pytorch.callbacks.throughput_monitor:ThroughputMonitor", "_t0s", "ThroughputMonitor"),
    ("lightning.pytorch.callbacks.throughput_monitor:ThroughputMonitor", "_samples", "ThroughputMonitor"),
    ("lightning.pytorch.callbacks.throughput_monitor:ThroughputMonitor", "_lengths", "ThroughputMonitor"),
    ("lightning.pytorch.callbacks.throughput_monitor:ThroughputMonitor", "_batches", "ThroughputMonitor"),
    ("lightning.pytorch.callbacks.throughput_monitor:ThroughputMonitor", "_compute", "ThroughputMonitor"),
    # Lightning: checkpoints (t6.training.callbacks.checkpoint, .preemption; t6.training.checkpoint_io)
    (CHECKPOINT, "_last_global_step_saved", "RunCheckpoint, lightning_private.last_saved_step"),
    (CHECKPOINT, "_save_last_checkpoint", "RunCheckpoint"),
    (CHECKPOINT, "_save_topk_checkpoint", "RunCheckpoint"),
    (CHECKPOINT, "_monitor_candidates", "RunCheckpoint"),
    (CHECKPOINT, "_link_checkpoint", "RunCheckpoint"),
    ("lightning.pytorch.plugins.io.async_plugin:AsyncCheckpointIO", "_ensure_setup", "BackgroundCheckpointIO"),
    ("lightning.pytorch.plugins.io.async_plugin:AsyncCheckpointIO", "_executor", "BackgroundCheckpointIO"),
    # Lightning: the progress bar (t6.training.progress)
    (RICH, "_initialize_train_progress_bar_id", "StepProgressBar"),
    (RICH, "_update_metrics", "StepProgressBar"),
    (RICH, "_update", "StepProgressBar"),
    # Lightning: FSDP (t6.training.fsdp)
    ("lightning.pytorch.strategies.fsdp:FSDPStrategy", "_setup_model", "T6FSDPStrategy"),
    ("lightning.pytorch.strategies.fsdp:FSDPStrategy", "_state_dict_type", "T6FSDPStrategy"),
    ("lightning.pytorch.strategies.fsdp:FSDPStrategy", "_activation_checkpointing_kwargs", "T6FSDPStrategy"),
    ("lightning.fabric.strategies.fsdp", "_move_torchmetrics_to_device", "lightning_private"),
    ("lightning.fabric.strategies.fsdp", "_setup_activation_checkpointing", "lightning_private"),
    ("lightning.fabric.strategies.model_parallel", "_load_raw_module_state", "lightning_private"),
    # Lightning's MLflow logger (t6.tracking.logger, .system_metrics)
    ("lightning.pytorch.loggers.mlflow:MLFlowLogger", "_run_id", "OutboxMLFlowLogger"),
    ("lightning.pytorch.loggers.mlflow:MLFlowLogger", "_initialized", "OutboxMLFlowLogger"),
    ("lightning.pytorch.loggers.mlflow:MLFlowLogger", "_tracking_uri", "lightning_private.tracking_uri"),
    ("lightning.pytorch.loggers.mlflow:MLFlowLogger", "_mlflow_client", "OutboxMLFlowLogger"),
    ("lightning.pytorch.loggers.mlflow:MLFlowLogger", "_run_name", "OutboxMLFlowLogger"),
    ("lightning.pytorch.loggers.mlflow:MLFlowLogger", "_experiment_id", "OutboxMLFlowLogger"),
    # MLflow's system metrics (t6.tracking.system_metrics)
    ("mlflow.system_metrics.system_metrics_monitor:SystemMetricsMonitor", "_shutdown_event", "NodeMonitor"),
    ("mlflow.system_metrics.system_metrics_monitor:SystemMetricsMonitor", "_metrics_prefix", "NodeMonitor"),
    ("mlflow.system_metrics.system_metrics_monitor:SystemMetricsMonitor", "_run_id", "NodeMonitor"),
    ("mlflow.system_metrics.system_metrics_monitor:SystemMetricsMonitor", "_process", "NodeMonitor"),
    # lm-eval (t6.evaluation.adapter, t6.bench.eval_items)
    ("lm_eval.api.model:TemplateLM", "_loglikelihood_tokens", "T6LM"),
    ("lm_eval.api.model:TemplateLM", "_encode_pair", "t6.bench.eval_items"),
    # transformers (t6.hf.modeling)
    ("transformers.generation.utils:GenerationMixin", "_prepare_cache_for_generation", "T6ForCausalLM"),
    ("transformers.modeling_utils:PreTrainedModel", "_init_weights", "T6ForCausalLM"),
    ("transformers.modeling_utils:PreTrainedModel", "_initialize_weights", "T6ForCausalLM"),
    ("transformers.modeling_utils:PreTrainedModel", "_is_hf_initialized", "T6ForCausalLM._initialize_weights"),
    ("transformers.modeling_utils:PreTrainedModel", "_set_gradient_checkpointing", "T6ForCausalLM"),
    # PyTorch: a module's hooks (t6.model.attention.base.plain_linear)
    ("torch.nn:Module", "_forward_hooks", "plain_linear"),
    ("torch.nn:Module", "_forward_pre_hooks", "plain_linear"),
    # PyTorch
    ("torch", "_dynamo", "t6.model.decode (its counters, reset), t6.bench.decode, t6.bench.generate"),
    ("torch", "_subclasses", "t6.hardware.memory (FakeTensorMode)"),
    ("torch", "_ops", "t6.bench.decode_kernels (OpOverload)"),
    ("torch._ops:OpOverload", "_schema", "t6.bench.decode_kernels"),
    ("torch.ops.mkldnn", "_is_mkldnn_bf16_supported", "t6.hardware.device"),
    ("torch.cpu", "_is_amx_tile_supported", "t6.hardware.device"),
    ("torch.utils", "_python_dispatch", "t6.bench.decode_kernels"),
    ("torch:UntypedStorage", "_cdata", "t6.hardware.memory"),
]


def owner(spec: str):
    module, _, cls = spec.partition(":")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError:  # a namespace reached by attribute, e.g. torch.ops.mkldnn
        parent, _, attr = module.rpartition(".")
        obj = getattr(importlib.import_module(parent), attr)
    return getattr(obj, cls) if cls else obj


def has_member(obj, name: str) -> bool:
    """A class attribute or method, an attribute the class declares (annotated), a module's member, or an instance
    attribute a class of the MRO sets in its own code (`self.name =` / `self.name:`)."""
    if hasattr(obj, name) or name in getattr(obj, "__annotations__", {}):  # a declared instance attribute too
        return True
    if isinstance(obj, type):
        for cls in obj.__mro__:
            try:
                source = inspect.getsource(cls)
            except (OSError, TypeError):
                continue
            if re.search(rf"self\.{re.escape(name)}\s*(:|=(?!=))", source):
                return True
    if inspect.ismodule(obj):
        try:
            importlib.import_module(f"{obj.__name__}.{name}")
            return True
        except ImportError:
            return False
    return False


@pytest.mark.parametrize("spec, name, user", PRIVATE, ids=[f"{s.split(':')[-1]}.{n}" for s, n, _ in PRIVATE])
def test_every_private_member_t6_uses_exists_in_the_pinned_versions(spec, name, user):
    assert has_member(owner(spec), name), f"{spec} has no {name} (used by {user}): the pinned library changed"


def own_private_names() -> set[str]:
    """Private names src/t6 defines itself: attributes it assigns, functions, classes and constants."""
    names = set()
    for path in (ROOT / "src" / "t6").rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"self\.(_[A-Za-z]\w*)\s*[:=]", text))
        names |= set(re.findall(r"^\s*(?:def|class)\s+(_[A-Za-z]\w*)", text, re.M))
        names |= set(re.findall(r"^(_[A-Za-z]\w*)\s*[:=]", text, re.M))
    return names


def test_every_private_member_of_a_library_used_in_src_is_in_the_table():
    pinned = {name for _, name, _ in PRIVATE}
    own = own_private_names() - pinned  # an override of a library's private method is the library's name
    unlisted = []
    for path in (ROOT / "src" / "t6").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = re.sub(r" as _\w+", "", line.split("#")[0])  # `import X as _Y`: a name of t6's own
            used = re.findall(r"\w\.(_[A-Za-z]\w*)", code) + re.findall(r"import .*?\b(_[A-Za-z]\w*)", code)
            used += re.findall(r"from [\w.]+\.(_[A-Za-z]\w*) import", code)
            for name in used:
                if name not in pinned and name not in own and not name.endswith("_"):  # `_target_`: Hydra's key
                    unlisted.append(f"{path.relative_to(ROOT)}:{n}: {name}")
    assert not unlisted, f"private members of a library with no row in PRIVATE: {unlisted}"
