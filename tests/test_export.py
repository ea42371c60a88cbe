"""Hugging Face export: the directory export.py writes loads with transformers' Auto classes and computes
the project's T6 (logits, greedy generation through each mechanism's own cache, for every registered
mechanism), its tokenizer encodes as t6.data.tokenizer, lm-eval's `hf` model scores it as the `t6`
adapter does, and the project reads it back (load_model, generate.py, eval.py, init_from)."""

from __future__ import annotations

import ast
import json
import shutil
import sys
from dataclasses import asdict, fields
from pathlib import Path

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from t6.bench.common import compose
from t6.data.corpus import TINY_SHAKESPEARE
from t6.data.tokenizer import EOT, gpt2_encoding
from t6.evaluation.evaluate import evaluate_checkpoint
from t6.hf.export import AUTO_MAP, check_export, sample_tokens, write_export
from t6.hf.export import run as export_run
from t6.hf.source import PACKAGE, carried_imports, carried_modules, export_sources, file_stem, relative
from t6.inference.generate import generate_text
from t6.inference.generate import main as generate_run
from t6.model import T6, ModelConfig
from t6.model.attention import Attention, Mechanism, available, get_mechanism
from t6.model.facts import kv_elements_per_token
from t6.model.load import load_model
from t6.model.t6 import left_pad
from t6.run.train import main as train
from t6.uptrain.convert import load_warm_start

from conftest import random_model

NAMES = available()  # every registered mechanism
VOCAB = 512  # the per-mechanism models: a small embedding, tokens below 512
SMALL_TASK = [
    f"eval.local_tasks.{t}.{k}={v}" for t in ("t6_next_line", "t6_cloze") for k, v in (("n_test", 12), ("n_fewshot", 4))
]


def save_training_checkpoint(model: T6, path: Path, **extra) -> Path:
    """The parts of a train.py (Lightning) checkpoint that t6.model.load reads."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"model_config": asdict(model.cfg)}, **extra}, path)
    return path


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """exports(name) -> (a random T6 of mechanism `name`, its exported directory), written once per module."""
    root = tmp_path_factory.mktemp("exports")
    made: dict[str, tuple[T6, Path]] = {}

    def export(name: str) -> tuple[T6, Path]:
        if name not in made:
            model = random_model(root, f"attention={name}", f"size.vocab_size={VOCAB}")
            ckpt = save_training_checkpoint(model, root / f"{name}.ckpt", global_step=3)
            made[name] = (model, write_export(ckpt, root / f"t6-{name}")[1])
        return made[name]

    return export


@pytest.mark.parametrize("name", NAMES)
def test_transformers_computes_the_t6_and_generates_its_greedy_tokens_from_its_own_cache(exports, name):
    model, out = exports(name)
    hf = load_hf(out)
    attn = hf.model.blocks[0].attn
    package = type(hf).__module__.rpartition(".")[0]  # the export's code, as transformers loaded it
    assert type(attn).__module__.rpartition(".")[0] == package and not type(attn).__module__.startswith("t6.")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=g)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9)]
    idx, mask = left_pad(prompts, pad_id=0)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=0, atol=1e-5)
        want = model.generate(tokens[:, :7], 12, temperature=0)
        got = hf.generate(
            tokens[:, :7],
            attention_mask=torch.ones(2, 7),
            max_new_tokens=12,
            do_sample=False,
            return_dict_in_generate=True,
        )
        assert torch.equal(got.sequences, want)
        # the cache generate() used holds what the attention declares (TPA's factors, MLA's latent, GQA's KV heads)
        assert [layer.kv.spec for layer in got.cache.layers] == [b.attn.cache_spec() for b in model.blocks]
        assert got.cache.layers[0].kv.elements_per_token() == kv_elements_per_token(model)
        want = model.generate(idx, 6, temperature=0, prompt_mask=mask)  # prompts of different lengths, left-padded
        assert torch.equal(hf.generate(idx, attention_mask=mask.long(), max_new_tokens=6, do_sample=False), want)


def test_cache_holds_each_mechanisms_own_quantities(exports):
    """GQA caches its KV heads only, MLA its latent and shared RoPE key, TPA its four factors."""
    shapes, attn = {}, {}
    for name in ("gqa", "mla", "tpa"):
        model, out = exports(name)
        cache = load_hf(out).build_cache(1, 8)  # one sequence of up to 8 tokens
        shapes[name] = {k: tuple(t.shape) for k, t in cache.layers[0].kv.tensors.items()}
        attn[name] = model.blocks[0].attn
    gqa, mla, tpa = attn["gqa"], attn["mla"], attn["tpa"]
    assert shapes["gqa"] == {k: (1, gqa.n_kv, 8, gqa.cfg.head_dim) for k in "kv"} and gqa.n_kv < gqa.cfg.n_head
    assert shapes["mla"] == {"c_kv": (1, 8, mla.d_c), "k_rope": (1, 8, mla.d_rope)}
    h, d = tpa.cfg.n_head, tpa.cfg.head_dim
    assert shapes["tpa"] == {
        "a_k": (1, 8, tpa.k_rank, h),
        "b_k": (1, 8, tpa.k_rank, d),
        "a_v": (1, 8, tpa.v_rank, h),
        "b_v": (1, 8, tpa.v_rank, d),
    }


def test_transformers_saves_it_again_and_beam_search_reorders_the_cache(exports, tmp_path):
    """A model fine-tuned and saved by transformers (sharded here) keeps its tied head and reads back into
    T6 Lab; beam search through the cache (reordered every step) equals beam search recomputing everything."""
    model, out = exports("mla")
    load_hf(out).save_pretrained(tmp_path / "saved", max_shard_size="300KB")
    assert (tmp_path / "saved" / "model.safetensors.index.json").is_file()
    again = load_hf(tmp_path / "saved")
    assert again.model.lm_head.weight is again.model.embed.weight
    loaded = load_model(tmp_path / "saved")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    beams = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, num_beams=3, do_sample=False)
    with torch.no_grad():
        assert torch.equal(again.generate(prompt, **beams), again.generate(prompt, **beams, use_cache=False))


def test_export_holds_the_config_weights_code_tokenizer_and_card(exports):
    model, out = exports("gqa")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["auto_map"]) == ("t6", ["T6ForCausalLM"], AUTO_MAP)
    assert {f.name: config[f.name] for f in fields(ModelConfig)} == asdict(model.cfg)  # attention and options too
    assert config["attention"] == "gqa"
    assert config["attention_options"] == {"output_gate": "none", "n_kv_head": model.blocks[0].attn.n_kv}
    assert (config["bos_token_id"], config["eos_token_id"], config["t6_source"]["steps"]) == (EOT, EOT, 3)
    weights = load_file(out / "model.safetensors")
    assert set(weights) == {f"model.{k}" for k in model.state_dict() if k != "lm_head.weight"}  # tied: stored once
    assert all(torch.equal(weights[f"model.{k}"], v) for k, v in model.state_dict().items() if k != "lm_head.weight")
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"], generation["do_sample"]) == (EOT, EOT, False)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast" and (out / "tokenizer.json").is_file()
    card = (out / "README.md").read_text()
    assert "# T6 (gqa)" in card and f"n_kv_head={model.blocks[0].attn.n_kv}" in card and "3 optimizer steps" in card
    assert "trust_remote_code=True" in card and "lm_eval --model hf" in card and "logits_cache=False" in card
    assert check_export(out, model, sample_tokens(model.cfg)) <= 1e-5


def test_the_code_files_are_the_projects_modules_with_relative_imports(exports):
    """Each code file of the export is its module's source with only its `t6` imports made relative (the registry
    also imports every mechanism; the operators are their eager forms), and the files import torch, transformers
    and the standard library only: nothing of t6, no C++ extension, Triton or Liger."""
    from transformers.dynamic_module_utils import get_imports

    _, out = exports("mha")
    files = {p.name: p.read_text() for p in out.glob("*.py")}
    assert files == export_sources()
    modules = carried_modules({n: get_mechanism(n) for n in NAMES})
    assert {get_mechanism(n).cls.__module__ for n in NAMES} <= set(modules)
    for module, source in modules.items():
        text = files[f"{file_stem(module)}.py"]
        assert text.startswith(relative(source)) and (module == PACKAGE or text == relative(source)), module
        changed = [(a, b) for a, b in zip(source.splitlines(), text.splitlines()) if a != b]
        assert all(a.strip().startswith("from t6.") and b.strip().startswith("from .") for a, b in changed)
    assert "_discovered = True" in files["attention.py"]
    fused = files["attention_fused_decode.py"]
    assert "tpa_decode = reference_tpa_decode" in fused and "latent_decode = reference_latent_decode" in fused
    for name in files:
        assert set(get_imports(out / name)) <= {*sys.stdlib_module_names, "torch", "transformers"}, name


def test_tokenizer_encodes_the_shipped_corpus_as_t6(exports):
    from transformers import AutoTokenizer

    _, out = exports("tpa")
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    enc = gpt2_encoding()
    text = TINY_SHAKESPEARE.read_text(encoding="utf-8")
    ids = tokenizer(text, verbose=False)["input_ids"]
    assert ids == enc.encode_ordinary(text) and len(ids) > 300_000
    assert tokenizer.decode(ids) == text
    for special in ("The end.<|endoftext|>Next", "<|endoftext|>", "  spaces   and\n\n\nnewlines  "):
        assert tokenizer(special)["input_ids"] == enc.encode(special, allowed_special={"<|endoftext|>"})
    ids = (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id)
    assert ids == (EOT, EOT, EOT) and len(tokenizer) == 50257
    batch = tokenizer(["ROMEO:", "JULIET: speak"], padding=True)  # a pipeline's or lm-eval's batches pad
    assert batch["input_ids"][0][-1] == EOT and batch["attention_mask"][0][-1] == 0


def test_what_is_not_a_t6_is_an_error_naming_it(tmp_path):
    torch.save({"state_dict": {}, "epoch": 1}, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match="ckpt_path='.*other.ckpt' is not a T6 checkpoint"):
        write_export(tmp_path / "other.ckpt", tmp_path / "out")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 12}))
    with pytest.raises(
        ValueError, match="ckpt_path='.*gpt2' is not a T6 export: its config.json has model_type='gpt2'"
    ):
        write_export(gpt2, tmp_path / "out")
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "t6", "attention": "xformer"}))
    with pytest.raises(ValueError, match="attention='xformer' is not a known mechanism"):
        load_model(gpt2)
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "t6"}))
    with pytest.raises(FileNotFoundError, match="has config.json but no model.safetensors"):
        load_model(gpt2)
    with pytest.raises(FileNotFoundError, match="init_from='.*' is a directory without config.json"):
        load_warm_start(tmp_path)


def test_a_config_field_of_the_wrong_type_is_an_error_naming_it_at_load(exports, tmp_path):
    """config.json edited by hand: a field of the wrong type is an error naming it when the directory loads, through
    transformers and through the project, not a TypeError inside a forward."""
    _, out = exports("mha")
    for field, value, says in [
        ("norm_eps", "abc", "size.norm_eps='abc' must be a positive number"),
        ("init_std", None, "size.init_std=None must be a positive number"),
        ("tie_embeddings", "yes", "size.tie_embeddings='yes' must be true or false"),
        ("attention_options", "abc", "attention.options='abc' must be a mapping of options"),
    ]:
        bad = tmp_path / field
        shutil.copytree(out, bad)
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(
            ValueError,
            match=f"ckpt_path='{bad}': its config.json does not build a T6 here: Invalid model config:\n  - {says}",
        ):
            load_model(bad)
        if field == "norm_eps":
            with pytest.raises(ValueError, match=f"{bad}/config.json does not describe a T6:\n  - {says}"):
                load_hf(bad)


class Outsider(Attention):
    """A mechanism defined outside t6.model.attention (here, in a test module)."""


def test_a_mechanism_the_export_cannot_carry_is_an_error_naming_it():
    every = {n: get_mechanism(n) for n in NAMES}
    with pytest.raises(ValueError, match=r"attention=outsider \(Outsider, test_export\) cannot be exported"):
        export_sources({**every, "outsider": Mechanism("outsider", Outsider, {})})
    fake = f"{PACKAGE}.fake"
    for source, why in [
        ("from t6.perf import mfu\n", "has `from t6.perf import mfu`"),
        ("import t6.model.layers\n", "has `import t6.model.layers`"),
        ("from t6.model import T6\n", "imports the package t6.model"),
    ]:
        with pytest.raises(ValueError, match=f"attention=fake cannot be exported: {fake} {why}"):
            carried_imports(fake, ast.parse(source), "attention=fake")


@pytest.fixture(scope="module")
def full_export(tmp_path_factory):
    """A random T6 with the real vocabulary (so text and the token shards fit it), exported by export.py's
    function with its config."""
    root = tmp_path_factory.mktemp("full")
    model = random_model(root, "attention=gqa")
    ckpt = save_training_checkpoint(model, root / "last.ckpt", global_step=7, mlflow_run_id="not-in-any-store")
    store = f"tracking_uri=sqlite:///{root / 'no-store' / 'mlflow.db'}"
    lines = export_run(compose("export", [f"ckpt_path={ckpt}", f"out={root / 't6-full'}", store], runtime=True))
    assert lines[0] == f"wrote {root / 't6-full'}: T6 (gqa), {6 + len(export_sources())} files" and lines[1].startswith(
        "checked: "
    )
    assert "not in this machine's store" in (root / "t6-full" / "README.md").read_text()
    return model, root / "t6-full"


def test_the_project_reads_an_export_back(full_export, make_cfg, tmp_path):
    """load_model (generate.py, eval.py, the t6 adapter) and init_from all take the directory."""
    model, out = full_export
    loaded = load_model(out)
    assert loaded.cfg == model.cfg and loaded.lm_head.weight is loaded.embed.weight
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    gen = compose("generate", [f"ckpt_path={out}", "prompt=ROMEO:", "max_new_tokens=5", "temperature=0", "device=cpu"])
    assert generate_run(gen) == generate_text(model, ["ROMEO:"], 5, temperature=0.0)

    ecfg = make_cfg(
        *SMALL_TASK, f"ckpt_path={out}", "eval.num_fewshot=[0]", "eval.limit=4", config_name="evaluate", small=False
    )
    metrics, run_id = evaluate_checkpoint(ecfg)
    client = mlflow.MlflowClient(tracking_uri=ecfg.tracking_uri)
    assert client.get_run(run_id).data.tags["source_run_id"] == "not-in-any-store"
    assert 0 <= metrics["eval/0shot/t6_next_line/acc_norm"] <= 1

    init = load_warm_start(out)  # fine-tuning from the directory: its weights and model shape, a fresh run
    assert all(torch.equal(init["state_dict"][k], v) for k, v in model.state_dict().items())
    cfg = make_cfg(f"init_from={out}", "trainer.max_steps=2", "trainer.val_check_interval=2")
    _, objects = train(cfg)
    assert objects["model"].model.cfg == model.cfg and objects["trainer"].global_step == 2
    run = mlflow.MlflowClient(tracking_uri=cfg.logger.mlflow.tracking_uri).get_run(objects["mlflow"].run_id)
    assert run.data.tags["init_from"] == str(out) and run.data.tags["source_run_id"] == "not-in-any-store"
    with pytest.raises(ValueError, match="is a Hugging Face directory: start from it with init_from="):
        train(make_cfg(f"ckpt_path={out}"))


def lm_eval_hf(out: Path, include: Path, shots: tuple[int, ...]) -> dict[int, dict]:
    """lm-eval's own `hf` model (HFLM, what `lm_eval --model hf` runs) on the directory, from the model_args the docs
    give -> its results per task, for each few-shot setting; in this process, where its command line would import
    everything and index lm-eval's built-in tasks again for each setting. logits_cache=False: lm-eval 0.4.13 groups
    requests whose context + continuation[:-1] agree and reads a shorter continuation's scores from the leading
    positions of the longer one's (t6_cloze and t6_next_line share text, so a few cloze items are misread;
    docs/export.md)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    args = f"pretrained={out},trust_remote_code=True,logits_cache=False"
    hf = HFLM.create_from_arg_string(args, {"batch_size": 16, "device": "cpu"})
    tasks = TaskManager(include_path=[str(include)], include_defaults=False)
    return {
        n: simple_evaluate(model=hf, tasks=["t6_cloze", "t6_next_line"], num_fewshot=n, task_manager=tasks,
                           fewshot_random_seed=1234, random_seed=None, numpy_random_seed=None,
                           torch_random_seed=None)["results"]
        for n in shots
    }  # fmt: skip


@pytest.mark.slow  # trains a tiny model and evaluates it, then lm-eval's hf model on its export
def test_lm_eval_hf_model_on_the_export_gives_the_runs_accuracies(make_cfg, tmp_path, shared_data_dir):
    cfg = make_cfg(*SMALL_TASK)
    metrics, objects = train(cfg)
    ckpt = Path(objects["trainer"].checkpoint_callback.dirpath) / "last.ckpt"
    model, out = write_export(ckpt, tmp_path / "t6-tiny", tracking_uri=cfg.logger.mlflow.tracking_uri)
    card = (out / "README.md").read_text()
    assert f"| t6_next_line, 2-shot | acc_norm | {metrics['eval/2shot/t6_next_line/acc_norm']:.4f} |" in card
    for shots, hf in lm_eval_hf(out, shared_data_dir / "eval", (0, 2)).items():
        for task in ("t6_next_line", "t6_cloze"):
            for metric in ("acc", "acc_norm"):
                assert hf[task][f"{metric},none"] == pytest.approx(
                    metrics[f"eval/{shots}shot/{task}/{metric}"], abs=1e-9
                )

    from transformers import AutoTokenizer

    tokenizer, hf_model = AutoTokenizer.from_pretrained(out, trust_remote_code=True), load_hf(out)
    prompt = tokenizer("ROMEO:", return_tensors="pt")
    with torch.no_grad():
        got = hf_model.generate(**prompt, max_new_tokens=30, do_sample=False)
        want = model.generate(prompt.input_ids, 30, temperature=0, stop_tokens=(EOT,))
    assert torch.equal(got, want)
