"""transformers' own model tests run against the export, for every registered mechanism: ModelTesterMixin
and ConfigTester of transformers 5.24.0, vendored from its source distribution under
tests/third_party/transformers_5_24 (see its README). The classes under test are the export's own, loaded
from a directory export.py wrote (remote code), on a very small model of each mechanism.

Every test of the mixin that applies runs and passes; the others are left out of the test classes, not collected,
each with its reason (NOT_APPLICABLE).
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
import tempfile
import types
import unittest
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import transformers

from t6.model.attention import available

from conftest import hf_config, tiny_model_config

PACKAGE = "third_party.transformers_5_24"  # README.md there: where the files come from
VERSION = "5.24.0"


def transformers_tests() -> tuple[types.ModuleType, types.ModuleType]:
    """(test_modeling_common, test_configuration_common) of the vendored transformers tests.

    The source distribution ships the top-level test files only; three modules they import are not in it,
    so they are given here for the import alone: `exporters.test_export.ExportTesterMixin` (a base class
    adding the torch.export tests: an empty base, those tests do not run), `generation.test_utils`
    (GenerationTesterMixin: a name the mixin checks inheritance against; its generation tests are not in
    the distribution, tests/test_hf_transformers.py checks generation) and `utils.test_configuration_utils`
    (`config_common_kwargs`, read by ConfigTester.check_config_arguments_init only, which is not run)."""
    stand_ins = {
        "exporters": {},
        "exporters.test_export": {"ExportTesterMixin": type("ExportTesterMixin", (), {})},
        "generation": {},
        "generation.test_utils": {"GenerationTesterMixin": type("GenerationTesterMixin", (), {})},
        "utils": {},
        "utils.test_configuration_utils": {"config_common_kwargs": {}},
    }
    for name, members in stand_ins.items():
        if f"{PACKAGE}.{name}" not in sys.modules:
            module = types.ModuleType(f"{PACKAGE}.{name}")
            module.__path__ = []  # a package, for the submodules below it
            vars(module).update(members)
            sys.modules[f"{PACKAGE}.{name}"] = module
    return (
        importlib.import_module(f"{PACKAGE}.test_modeling_common"),
        importlib.import_module(f"{PACKAGE}.test_configuration_common"),
    )


common, configuration_common = transformers_tests()

# The mixin's tests that do not apply to a T6, by reason: left out of the test classes, so they are not collected
# (each name is a test of the mixin, or the base name of its parameterized tests). Every other test runs on every
# mechanism and passes: none skips.
NOT_APPLICABLE = {
    "needs a GPU, an accelerator library (flash-attn, kernels, DeepSpeed) or several devices; this suite runs on the "
    "CPU": [
        "test_flash_attn_kernels_inference_equivalence",
        "test_flash_attn_kernels_mps_inference_equivalence",
        "test_flash_attn_2_inference_equivalence",
        "test_flash_attn_2_inference_equivalence_right_padding",
        "test_flash_attn_3_inference_equivalence",
        "test_flash_attn_3_inference_equivalence_right_padding",
        "test_flash_attn_4_inference_equivalence",
        "test_flash_attn_4_inference_equivalence_right_padding",
        "test_flash_attn_2_can_dispatch_composite_models",
        "test_flash_attn_3_can_dispatch_composite_models",
        "test_flash_attn_4_can_dispatch_composite_models",
        "test_flash_attn_2_fp32_ln",
        "test_flash_attn_2_can_compile_with_attention_mask_None_without_graph_break",
        "test_flash_attn_2_from_config",
        "test_flash_attn_3_from_config",
        "test_flash_attn_4_from_config",
        "test_sdpa_can_dispatch_on_flash",
        "test_sdpa_can_compile_dynamic",
        "test_flex_attention_with_grads",
        "test_disk_offload_bin",
        "test_disk_offload_safetensors",
        "test_cpu_offload",
        "test_model_parallelism",
        "test_can_load_with_device_context_manager",
        "test_can_load_with_global_device_set",
        "test_resize_tokens_embeddings_with_deepspeed",
        "test_resize_tokens_embeddings_with_deepspeed_multi_gpu",
        "test_resize_embeddings_untied_with_deepspeed",
        "test_resize_embeddings_untied_with_deepspeed_multi_gpu",
        "test_kernels_can_load_without_crashing",
    ],
    "another architecture's feature: a T6 has no mixture of experts, sliding window, feed-forward chunking, "
    "position-embedding table, rope scaling, tensor-parallel plan, weight-name conversion, base model class, "
    "fp32-kept modules, classification heads, encoder-decoder, sub-configs or other modalities": [
        "test_moe_models_record_router_logits",
        "test_output_router_logits_from_config",
        "test_eager_matches_batched_and_grouped_inference",  # grouped_mm: the experts' implementation
        "test_sliding_window_mask",
        "test_feed_forward_chunking",
        "test_resize_position_vector_embeddings",
        "test_model_rope_scaling_from_config",
        "test_model_rope_scaling_frequencies",
        "test_vision_axial_rope",
        "test_model_rope_with_partial_rotation",
        "test_tp_plan_matches_params",
        "test_reverse_loading_mapping",
        "test_can_load_from_already_mapped_keys",
        "test_base_model_prefix_loads_base_weights",
        "test_torch_save_load",
        "test_keep_in_fp32_modules",
        "test_keep_in_fp32_modules_exist",
        "test_keep_in_fp32_modules_strict_also_hardcode_fp32",
        "test_problem_types",
        "test_encoder_decoder_loss_no_double_shift",
        "test_attn_implementation_composite_models",
        "test_sdpa_can_dispatch_composite_models",
        "test_can_set_attention_dynamically_composite_model",
        "test_internal_model_config_and_subconfig_are_same",
        "test_multimodal_outputs_are_returned",
        "test_get_text_features_output",
        "test_get_text_features_hidden_states",
        "test_get_text_features_attentions",
        "test_get_image_features_output",
        "test_get_image_features_pooler_output",
        "test_get_image_features_hidden_states",
        "test_get_image_features_attentions",
        "test_get_audio_features_output",
        "test_get_audio_features_hidden_states",
        "test_get_audio_features_attentions",
        "test_get_video_features_output",
        "test_get_video_features_pooler_output",
        "test_get_video_features_hidden_states",
        "test_get_video_features_attentions",
    ],
    "transformers' machinery for its own models, which a T6 does not use: DynamicCache (a T6 caches what its "
    "attention declares, T6Cache; `past_key_values` as the cache's former name is tested in "
    "tests/test_hf_transformers.py), output capture (capture_outputs, _can_record_outputs: a T6 returns hidden "
    "states and attentions from its own forward), and the registry of transformers' causal LMs (shift_labels: tested "
    "in tests/test_hf_transformers.py)": [
        "test_bc_cache_name_forward",
        "test_capture_outputs_decorator",
        "test_format_of_can_record_outputs",
        "test_can_capture_specific_layers_hidden_states",
        "test_causal_lm_loss_honors_shift_labels",
    ],
    "compiles the whole model with inductor (minutes on two CPU cores, transformers' @slow); T6's own compiled "
    "training is tested in tests/test_model.py": [
        "test_torch_compile_for_training",
    ],
    "GenerationTesterMixin is not in transformers' source distribution (tests/generation is left out of it); "
    "generate() is tested in tests/test_hf_transformers.py and tests/test_export.py": [
        "test_generation_tester_mixin_inheritance",
    ],
}


def is_named(test: str, name: str) -> bool:
    """Whether the mixin's test `test` is `name` or one of its parameterized tests (`name`_<index>_<parameters>)."""
    return re.fullmatch(rf"{name}(_\d+_\w+)?", test) is not None


def left_out(test: str) -> str | None:
    """The reason the mixin's test `test` does not apply (NOT_APPLICABLE), or None."""
    for reason, names in NOT_APPLICABLE.items():
        if any(is_named(test, name) for name in names):
            return reason
    return None


class T6ModelTester:
    """What ModelTesterMixin asks of a model tester: a small config of one mechanism and its inputs."""

    batch_size = 2
    seq_length = 7
    is_training = True
    vocab_size = 99

    def __init__(self, parent, config_class, cfg):
        self.parent, self.config_class, self.cfg = parent, config_class, cfg
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = cfg.d_model, cfg.n_layer, cfg.n_head

    def get_config(self):
        return hf_config(self.config_class, self.cfg)

    def prepare_config_and_inputs_for_common(self):
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 1)  # below the pad id
        mask = torch.ones_like(input_ids)
        mask[0, :2] = 0  # one row left-padded
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


class T6MixinTest(common.ModelTesterMixin):
    """ModelTesterMixin on the exported T6ForCausalLM of one mechanism (`attention`, set per subclass)."""

    attention = ""
    test_torch_exportable = False  # ExportTesterMixin's tests are not in the source distribution
    test_all_params_have_gradient = True
    test_can_init_all_missing_weights_before_2023 = True  # the mixin runs it for models it dates from 2023 on

    @pytest.fixture(autouse=True)
    def exported(self, hf_classes):
        self.config_class, self.model_class = hf_classes
        self.model_tester = T6ModelTester(self, self.config_class, model_config(self.attention))

    @property
    def all_model_classes(self):
        return (self.model_class,)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        """The mixin's own, with the labels it gives the causal LMs of transformers' Auto classes (a T6 is not one)."""
        inputs = super()._prepare_for_class(inputs_dict, model_class, return_labels)
        if return_labels:
            inputs["labels"] = torch.zeros_like(inputs["input_ids"])
        return inputs

    def test_config(self):
        """ConfigTester's common checks (check_config_arguments_init reads config_common_kwargs, which is not in
        the source distribution)."""
        cfg = self.model_tester.cfg
        tester = configuration_common.ConfigTester(self, config_class=self.config_class, **asdict(cfg))
        tester.create_and_test_config_common_properties()
        tester.create_and_test_config_to_json_string()
        tester.create_and_test_config_to_json_file()
        tester.create_and_test_config_from_and_save_pretrained()
        tester.create_and_test_config_from_and_save_pretrained_subfolder()
        tester.create_and_test_config_with_num_labels()
        tester.check_config_can_be_init_without_params()


def test_the_vendored_tests_are_the_pinned_transformers():
    assert transformers.__version__ == VERSION, "re-vendor tests/third_party/transformers_5_24 for this transformers"


@functools.cache
def model_config(attention: str):
    return tiny_model_config(Path(tempfile.gettempdir()), attention)  # composes the config, writes nothing


def mixin_tests() -> list[str]:
    return sorted(name for name in dir(common.ModelTesterMixin) if name.startswith("test_"))


def test_every_test_left_out_is_one_of_the_mixin():
    """Each name in NOT_APPLICABLE is a test of the vendored mixin (a re-vendored one that renames it fails here)."""
    tests = mixin_tests()
    for names in NOT_APPLICABLE.values():
        for name in names:
            assert any(is_named(test, name) for test in tests), name


QUICK = ("mha", "tpa")  # the mechanisms whose mixin runs stay in the quick subset (-m 'not slow'); CI runs all


def mixin_test_class(attention: str) -> type:
    """The mixin's test case for one mechanism, without the tests that do not apply (NOT_APPLICABLE): a member that
    is not callable is not a test, to unittest and pytest alike."""
    members = {"attention": attention, **{test: None for test in mixin_tests() if left_out(test)}}
    cls = type(f"TestT6Mixin_{attention}", (T6MixinTest, unittest.TestCase), members)
    return cls if attention in QUICK else pytest.mark.slow(cls)  # ~15 s each on two cores


globals().update({f"TestT6Mixin_{name}": mixin_test_class(name) for name in available()})
