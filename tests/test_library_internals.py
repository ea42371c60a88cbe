"""The private members of the libraries t6 builds on (Lightning, PyTorch, lm-eval, transformers), all in one table,
each with the reason no public member does its job, each checked against the installed, pinned versions: an
upgrade that renames or drops one fails here, by name, instead of breaking a run silently; one that deprecates it
fails here too (the member is read with deprecation warnings raised as errors). A private member used in src/t6
without a row fails as well.

Behaviour that rests on them is tested where it lives: the stop protocol (tests/test_stop.py,
tests/test_faults.py), FSDP on the CPU (tests/test_distributed.py), the evaluation adapter (tests/test_evaluation.py),
the Hugging Face export's generate() (tests/test_export.py), the step-memory model (tests/test_hardware.py)."""

from __future__ import annotations

import importlib
import inspect
import re
import warnings

import pytest

from conftest import ROOT

# (owner: "module:Class" or "module", private name, where t6 uses it, why no public member does)
PRIVATE = [
    (
        "lightning.pytorch.trainer.trainer:Trainer",
        "_signal_connector",
        "t6.training.stop.lightning_signals_off",
        "Lightning 2.6 installs a SIGTERM handler that broadcasts inside the handler and stops each rank on its own "
        "flag (ranks hang in each other's collectives); no setting leaves it out",
    ),
    (
        "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop",
        "_broadcast_sigterm_tensor",
        "t6.training.stop.lightning_signals_off",
        "Lightning 2.6 broadcasts rank 0's SIGTERM flag before every micro-batch (a collective and a host read "
        "each); no setting turns it off",
    ),
    (
        "lightning.pytorch.strategies.fsdp:FSDPStrategy",
        "_setup_model",
        "t6.training.fsdp.T6FSDPStrategy",
        "FSDP on the CPU (the tests' sharding, clipping and resume) needs device_id=cpu, which Lightning does not "
        "pass; the model is wrapped nowhere else",
    ),
    (
        "lm_eval.api.model:TemplateLM",
        "_loglikelihood_tokens",
        "t6.evaluation.adapter.T6LM",
        "TemplateLM's abstract method: the one lm-eval asks a model to implement",
    ),
    (
        "transformers.generation.utils:GenerationMixin",
        "_prepare_cache_for_generation",
        "t6.hf.modeling.T6ForCausalLM",
        "generate() builds its cache here; a T6 caches what its attention declares (T6Cache), which no "
        "cache_implementation names",
    ),
    (
        "transformers.modeling_utils:PreTrainedModel",
        "_init_weights",
        "t6.hf.modeling.T6ForCausalLM",
        "the method transformers documents for a custom model's initialization (missing weights, resized "
        "embeddings): T6's own, module by module",
    ),
    (
        "transformers.modeling_utils:PreTrainedModel",
        "_initialize_weights",
        "t6.hf.modeling.T6ForCausalLM",
        "transformers 5.24 passes over a remote-code module without parameters of its own; a T6 attention or SwiGLU "
        "initializes its layers itself, so the export keeps the rest of it without that shortcut",
    ),
    (
        "transformers.configuration_utils:PreTrainedConfig",
        "_attn_implementation",
        "t6.hf.modeling.T6ForCausalLM (__init__, forward)",
        "the attn_implementation transformers resolved (from_pretrained, set_attn_implementation), which each of its "
        "models reads to choose its attention; no public accessor",
    ),
    (
        "torch.nn:Module",
        "_forward_hooks",
        "t6.model.attention.base.plain_linear",
        "whether a projection has a forward hook (which would change what it computes): no public accessor",
    ),
    (
        "torch.nn:Module",
        "_forward_pre_hooks",
        "t6.model.attention.base.plain_linear",
        "whether a projection has a forward pre-hook: no public accessor",
    ),
    (
        "torch",
        "_dynamo",
        "t6.model.static_decode (mark_static_address, config.recompile_limit), t6.bench.step_overhead and "
        "t6.bench.fusion (reset), t6.hardware.compile_cache (utils.counters)",
        "a CUDA graph's fixed input addresses, the recompile limit and the compile caches' hit counts have no "
        "torch.compiler equivalent in 2.13",
    ),
    (
        "torch",
        "_inductor",
        "t6.bench.fusion (compile_fx with its inner compile, config._post_fusion_custom_pass, the scheduler's nodes "
        "and their bytes)",
        "what inductor fuses and the bytes each kernel moves, for a GPU's code generator on a machine without one; "
        "torch.compile's public API runs the code instead of describing it",
    ),
    (
        "torch",
        "_functorch",
        "t6.model.t6.eager_backward_compile (config.force_non_lazy_backward_lowering)",
        "AOTAutograd compiles a backward at the first backward call, outside the compile fallback's guard; only "
        "its config compiles it with the forward",
    ),
    (
        "torch.utils",
        "_pytree",
        "t6.inference.memory.PeakMemory (tree_flatten)",
        "the tensors among an operator's nested arguments and outputs; torch.utils has no public flatten",
    ),
    (
        "torch",
        "_subclasses",
        "t6.training.step_memory, t6.inference.memory (FakeTensorMode)",
        "tracing a training step or a prefill without memory needs fake tensors; the meta device loses storage sharing",
    ),
    (
        "torch:UntypedStorage",
        "_cdata",
        "t6.training.step_memory, t6.inference.memory",
        "the identity of a fake tensor's storage (views share it); data_ptr() is 0 for every fake storage",
    ),
    (
        "torch.ops.mkldnn",
        "_is_mkldnn_bf16_supported",
        "t6.hardware.device.cpu_amx_bf16",
        "whether oneDNN runs bf16 matmuls on this CPU; torch.backends.mkldnn says only whether it is built",
    ),
    ("torch.cpu", "_is_amx_tile_supported", "t6.hardware.device.cpu_amx_bf16", "torch.cpu has no public AMX probe"),
    (
        "torch.utils",
        "_python_dispatch",
        "t6.bench.decode_kernels, t6.inference.memory (TorchDispatchMode)",
        "seeing which operator a decode step dispatches to; torch.overrides sees functions, not operators",
    ),
    (
        "torch._ops:OpOverload",
        "_schema",
        "t6.bench.decode_kernels",
        "an operator's argument names, to record a call by name",
    ),
]


# Public but undocumented members t6 builds on (a library's module or class its reference does not describe), with
# the same checks: (owner, member, where t6 uses it, why no documented member does).
UNDOCUMENTED = [
    (
        "mlflow.system_metrics.system_metrics_monitor:SystemMetricsMonitor",
        name,
        "t6.tracking.system_metrics.NodeMonitor",
        "MLflow documents system metrics only as a switch of the active run (log_system_metrics), logging through its "
        "own client and stopping at the first failed write; the run's monitor samples with MLflow's monitors and "
        "logs through the run's outbox (t6.tracking.outbox), at the training step",
    )
    for name in ("monitors", "collect_metrics", "aggregate_metrics", "sampling_interval", "node_id")
] + [
    (
        "mlflow.system_metrics.metrics.base_metrics_monitor:BaseMetricsMonitor",
        "clear_metrics",
        "t6.tracking.system_metrics.NodeMonitor.publish_metrics",
        "each monitor's samples since the last publication are dropped once logged, as MLflow's own loop does",
    ),
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
    if hasattr(obj, name) or name in getattr(obj, "__annotations__", {}):
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


@pytest.mark.parametrize(
    "spec, name, user, reason",
    PRIVATE + UNDOCUMENTED,
    ids=[f"{s.split(':')[-1]}.{n}" for s, n, *_ in PRIVATE + UNDOCUMENTED],
)
def test_every_private_member_t6_uses_exists_in_the_pinned_versions(spec, name, user, reason):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # a member on its way out fails here, by name
        warnings.simplefilter("error", FutureWarning)
        assert has_member(owner(spec), name), f"{spec} has no {name} (used by {user}): the pinned library changed"
    assert reason, f"{spec}.{name} needs the reason no public member does its job"


def test_the_table_is_short():
    assert len(PRIVATE) <= 20, "each private member is a maintenance debt: find the public one"


def test_a_private_attribute_a_library_base_class_defines_is_the_librarys():
    """`self._rank = ...` in a subclass of lm-eval's LM sets lm-eval's own attribute: it needs a row like any private
    member (or the public property instead); t6's own private attributes are not looked up."""
    unlisted = {name: where for name, where in library_attributes().items() if name not in {n for _, n, *_ in PRIVATE}}
    assert not unlisted, f"private attributes of a library base class set in src/t6: {unlisted}"


def library_attributes() -> dict[str, str]:
    """The private attributes src/t6 assigns (`self._x = ...`) in a class whose library base class (Lightning's,
    lm-eval's LM, ...) has that member: the library's names, not t6's own -> where."""
    import ast

    found = {}
    for path in (ROOT / "src" / "t6").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT / "src").with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or not node.bases:
                continue
            assigned = {
                target.attr
                for sub in ast.walk(node)
                for target in getattr(sub, "targets", [getattr(sub, "target", None)])
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                and target.value.id == "self" and target.attr.startswith("_") and not target.attr.endswith("__")
            }  # fmt: skip
            if not assigned:
                continue
            cls = getattr(importlib.import_module(module), node.name, None)
            bases = [b for b in getattr(cls, "__mro__", ())[1:] if not b.__module__.startswith("t6")]
            for name in assigned:
                if any(b is not object and has_member(b, name) for b in bases):
                    found[name] = f"{module}.{node.name}"
    return found


def own_private_names() -> set[str]:
    """Private names src/t6 defines itself: attributes it assigns (unless a library base class has them: those are
    the library's), functions, classes and constants."""
    names = set()
    for path in (ROOT / "src" / "t6").rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"self\.(_[A-Za-z]\w*)\s*[:=]", text))
        names |= set(re.findall(r"^\s*(?:def|class)\s+(_[A-Za-z]\w*)", text, re.M))
        names |= set(re.findall(r"^(_[A-Za-z]\w*)\s*[:=]", text, re.M))
    return names - set(library_attributes())


def test_every_private_member_of_a_library_used_in_src_is_in_the_table():
    pinned = {name for _, name, _, _ in PRIVATE}
    own = own_private_names() - pinned  # an override of a library's private method is the library's name
    unlisted = []
    for path in (ROOT / "src" / "t6").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = re.sub(r" as _\w+", "", line.split("#")[0])  # `import X as _Y`: a name of t6's own
            used = re.findall(r"\w\.(_[A-Za-z]\w*)", code) + re.findall(r"import .*?\b(_[A-Za-z]\w*)", code)
            used += re.findall(r"(?:get|has|set|del)attr\([^,]+,\s*[\"'](_[A-Za-z]\w*)[\"']", code)  # by its name
            used += re.findall(r"from [\w.]+\.(_[A-Za-z]\w*) import", code)
            for name in used:
                if name not in pinned and name not in own and not name.endswith("_"):  # `_target_`: Hydra's key
                    unlisted.append(f"{path.relative_to(ROOT)}:{n}: {name}")
    assert not unlisted, f"private members of a library with no row in PRIVATE: {unlisted}"
