"""The tokenizer travels with the model: shards in any tokenizer (uint32 past 65,536 tokens), data preparation,
evaluation, generation and export in the imported model's own tokenizer, equal to transformers' and lm-eval's `hf`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from t6.data.corpus import TINY_SHAKESPEARE, current_manifest, prepare_text_corpus, split_text
from t6.data.datamodule import TokenDataModule
from t6.data.shards import HEADER_BYTES, Manifest, read_shard, write_shard
from t6.data.tokenizer import PretrainedTokenizer, from_spec, gpt2, load_tokenizer

from tiny_llama import BOS, EOS, save_llama_directory, tiny_tokenizer


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    return out, save_llama_directory(out)


def wide_tokenizer() -> PretrainedTokenizer:
    """A word-level tokenizer whose words of the corpus have ids above 65,535."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(TINY_SHAKESPEARE.read_text()[:20_000].split()))
    vocab = {"[UNK]": 0, "</s>": 1} | {w: 65_536 + i for i, w in enumerate(words)}
    vocab |= {f"<unused{i}>": i for i in range(2, 65_536)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PretrainedTokenizer(tok.to_str(), "wide", eot=1)


def test_a_vocabulary_past_65535_makes_uint32_shards(tmp_path):
    tok = wide_tokenizer()
    assert tok.n_vocab > 65_536 and tok.dtype == np.uint32 and gpt2().dtype == np.uint16
    text = tmp_path / "corpus.txt"
    text.write_text(TINY_SHAKESPEARE.read_text()[:20_000])
    manifest = prepare_text_corpus(text, tmp_path / "shards", tokenizer=tok)
    assert manifest.tokenizer == tok.id and manifest.tokenizer_name == "wide"
    train = read_shard(tmp_path / "shards" / "train_000000.bin")
    assert train.dtype == np.uint32 and int(train.max()) > 65_535 and train[0] == tok.eot
    train_text, _ = split_text(text)
    assert train[1:].tolist() == tok.encode(train_text)
    dm = TokenDataModule(str(tmp_path / "shards"), seq_len=16, batch_size=2, tokenizer=tok)
    dm.setup()
    x, y = dm.train_windows.get(3)
    assert int(x.max()) > 65_535 and torch.equal(x[1:], y[:-1])
    # a shard written before the header named its bytes per token (zero there) reads as uint16
    old = tmp_path / "old.bin"
    write_shard(old, np.arange(10, dtype=np.uint16))
    raw = bytearray(old.read_bytes())
    raw[12:16] = b"\0\0\0\0"
    old.write_bytes(bytes(raw))
    assert read_shard(old).tolist() == list(range(10)) and old.stat().st_size == HEADER_BYTES + 20


def test_the_corpus_splits_at_one_place_for_every_tokenizer(llama_dir, tmp_path):
    """Another tokenizer's shards hold the same training and validation text as GPT-2's (the local tasks are
    built from that validation text), in a folder of their own."""
    tok = load_tokenizer(llama_dir[0])
    dm = TokenDataModule(str(tmp_path / "tinyshakespeare"), 32, 2, embedded=True, tokenizer=str(llama_dir[0]))
    dm.prepare_data()
    assert dm.data_dir.name == f"tinyshakespeare-{tok.id.replace(':', '-')}"
    manifest = Manifest.load(dm.data_dir)
    assert current_manifest(TINY_SHAKESPEARE, dm.data_dir, tokenizer=tok).shards == manifest.shards  # current
    assert current_manifest(TINY_SHAKESPEARE, dm.data_dir) is None  # GPT-2's shards are not these
    dm.check()  # the plan's check: each split holds a sequence, in this tokenizer's tokens
    shards = {s["split"]: read_shard(dm.data_dir / s["file"]) for s in manifest.shards}
    train_text, val_text = split_text(TINY_SHAKESPEARE)
    assert tok.decode(shards["val"][1:].tolist()) == val_text
    assert tok.decode(shards["train"][1:].tolist()) == train_text
    gpt2_train = prepare_text_corpus(TINY_SHAKESPEARE, tmp_path / "gpt2").shards[0]
    assert gpt2().decode(read_shard(tmp_path / "gpt2" / gpt2_train["file"])[1:].tolist()) == train_text


def test_data_preparation_in_a_pretrained_tokenizer(llama_dir, tmp_path):
    import t6.data.prepare as prepare

    docs = [d for d in TINY_SHAKESPEARE.read_text().split("\n\n")[:60] if d]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = load_tokenizer(llama_dir[0])
    manifest = prepare.prepare_dataset(
        tmp_path / "out", path="json", config=None, data_files=str(path), shard_tokens=500, num_proc=2,
        progress_bar=False, tokenizer=tok,
    )  # fmt: skip
    assert manifest.tokenizer == tok.id
    tokens = np.concatenate([read_shard(tmp_path / "out" / s["file"]) for s in manifest.shards])
    assert tokens.tolist() == [t for d in docs for t in [tok.eot, *tok.encode(d)]]
    assert from_spec(tok.spec()) == tok and tok.encode(docs[0]) == tiny_tokenizer().encode(docs[0]).ids


def test_evaluation_in_the_models_tokenizer_equals_lm_eval_hf(llama_dir):
    """The same requests scored by the t6 adapter on the imported model and by lm-eval's own `hf` model."""
    from lm_eval.models.huggingface import HFLM

    from t6.evaluation.adapter import T6LM

    path, _ = llama_dir
    requests = [
        ("ROMEO:\nBut soft, what light", " through yonder window"),
        ("First Citizen:\nBefore we proceed any further,", " hear me speak."),
        ("All:\nSpeak,", " speak."),
    ]
    instances = [type("Req", (), {"args": r})() for r in requests]
    ours = T6LM(checkpoint=str(path), batch_size=2).loglikelihood(instances, disable_tqdm=True)
    theirs = HFLM(pretrained=str(path), batch_size=2, device="cpu", dtype="float32").loglikelihood(
        instances, disable_tqdm=True
    )
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b


def test_generation_in_the_models_tokenizer_equals_transformers(llama_dir):
    from omegaconf import OmegaConf

    from t6.inference.generate import main as run

    path, hf = llama_dir
    tok = tiny_tokenizer()
    prompt = "ROMEO:\nBut soft"
    cfg = OmegaConf.create(
        dict(ckpt_path=str(path), prompt=prompt, max_new_tokens=12, temperature=0.0, top_k=None, top_p=None,
             stop_at_eot=False, seed=0, device="cpu")
    )  # fmt: skip
    ids = torch.tensor([tok.encode(prompt).ids])
    want = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert run(cfg) == [tok.decode(want[0].tolist(), skip_special_tokens=False)]


@pytest.fixture(scope="module")
def converted_export(llama_dir, tmp_path_factory):
    """The tiny Llama imported, converted into MQA (its KV heads pooled) and exported -> (the T6, the directory)."""
    from t6.hf.export import write_export
    from t6.uptrain.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("converted")
    convert_checkpoint(llama_dir[0], "mqa", out=root / "mqa.ckpt")
    return write_export(root / "mqa.ckpt", root / "t6-mqa")


def test_a_converted_pretrained_model_exports_with_its_own_tokenizer(llama_dir, converted_export):
    """The directory carries the Llama's tokenizer (its special tokens, chat template, end of text as pad), which
    transformers and the project read back, and records its token ids in config.json."""
    from transformers import AutoTokenizer

    from t6.hf.export import check_export, sample_tokens

    (path, _), (model, out) = llama_dir, converted_export
    source, tok = AutoTokenizer.from_pretrained(path), load_tokenizer(path)
    assert load_tokenizer(out) == tok and load_tokenizer(out).spec() == tok.spec()  # the project reads it back
    exported = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    text = TINY_SHAKESPEARE.read_text()[:5000] + f"{EOS}{BOS}"
    assert exported(text)["input_ids"] == source(text)["input_ids"] == tok.encode(text)
    chat = [{"role": "user", "content": "Speak."}, {"role": "assistant", "content": "Speak, I say."}]
    assert exported.apply_chat_template(chat, tokenize=False) == source.apply_chat_template(chat, tokenize=False)
    ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}  # no pad token of its own: the end of text
    assert (exported.bos_token_id, exported.eos_token_id, exported.pad_token_id) == tuple(ids.values())
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert {k: config[k] for k in ids} == {k: generation[k] for k in ids} == ids
    assert config["t6_tokenizer"]["id"] == tok.id and "json" not in config["t6_tokenizer"]
    assert "the pretrained model's own" in (out / "README.md").read_text()
    assert check_export(out, model, sample_tokens(model.cfg, tok)) <= 1e-5  # Llama 3's RoPE remap too


@pytest.mark.slow  # eval.py and lm-eval's hf model on the export, 0- and 2-shot (~25 s on two shared cores)
def test_lm_eval_hf_scores_a_converted_pretrained_export_as_the_t6_adapter(converted_export, make_cfg):
    """lm-eval's `hf` model gives the export the accuracies eval.py's `t6` adapter gives it on the local tasks."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from t6.evaluation.callback import EvalSettings, build_eval_callback
    from t6.evaluation.evaluate import evaluate_checkpoint
    from t6.evaluation.runner import flat_metrics

    _, out = converted_export
    tasks = [
        f"eval.local_tasks.{t}.{k}={v}"
        for t in ("t6_next_line", "t6_cloze")
        for k, v in (("n_test", 8), ("n_fewshot", 4))
    ]
    ecfg = make_cfg(*tasks, f"ckpt_path={out}", "eval.limit=8", config_name="evaluate", small=False)
    ours, _ = evaluate_checkpoint(ecfg)  # eval.py: the t6 adapter, in the tokenizer it reads back from the directory
    callback = build_eval_callback(EvalSettings.read(ecfg.eval))
    spec = callback.spec
    hf = HFLM(pretrained=str(out), trust_remote_code=True, logits_cache=False, batch_size=4, device="cpu")
    results = {
        n: simple_evaluate(model=hf, tasks=spec.tasks, num_fewshot=n, limit=spec.limit, fewshot_random_seed=1234,
                           task_manager=callback.task_manager, random_seed=None, numpy_random_seed=None,
                           torch_random_seed=None)
        for n in spec.num_fewshot
    }  # fmt: skip
    theirs = flat_metrics(results, spec)
    assert set(theirs) == set(ours) and len(ours) >= 8
    assert all(theirs[k] == pytest.approx(ours[k], abs=1e-9) for k in ours), (ours, theirs)
