"""Conversion of a pretrained (GQA) model's attention into other mechanisms: shapes, the closed forms'
exact parts, layer-wise distillation lowering every layer's attention-output error, the converted
checkpoint's record, and the conversion's MLflow runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from t6.data.corpus import TINY_SHAKESPEARE
from t6.model.load import load_model
from t6.uptrain.closed_form import rope_subset
from t6.uptrain.convert import convert_checkpoint, convert_model, target_config
from t6.uptrain.distill import calibration_batches, input_statistics

from tiny_llama import save_llama_directory, tiny_tokenizer

SEQ = 48


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random GQA Llama (4 query heads of 24, 2 KV heads) as a T6, and calibration / held-out windows
    of the corpus in its own tokenizer."""
    path = tmp_path_factory.mktemp("llama")
    save_llama_directory(path)
    ids = torch.tensor(tiny_tokenizer().encode(TINY_SHAKESPEARE.read_text()[:60_000]).ids)
    windows = ids[: (len(ids) // SEQ) * SEQ].view(-1, SEQ)  # [N, SEQ]
    calibration = [windows[i : i + 4] for i in range(0, 24, 4)]  # 6 batches of 4
    held = [windows[-8:-4], windows[-4:]]
    return path, load_model(path), calibration, held


TARGETS = [
    ("mqa", None, {}),
    ("gqa", 4, {}),  # more KV heads than the source: each repeated
    ("mla", None, {"kv_lora_rank": 32, "rope_dim": 12}),
    ("tpa_kvonly", None, {"k_rank": 1, "v_rank": 1}),
    ("tpa", None, {"k_rank": 2, "v_rank": 2}),
    ("gla", None, {"kv_lora_rank": 16, "q_lora_rank": 32, "rope_dim": 8}),  # no closed form: its own init
    ("tpa_nc_a", None, {}),
]


@pytest.mark.parametrize("target, kv_heads, options", TARGETS, ids=[t[0] for t in TARGETS])
def test_converted_shapes_and_start(llama, target, kv_heads, options):
    _, source, calibration, held = llama
    cfg = target_config(source.cfg, target, kv_heads, options)
    model, record = convert_model(source, cfg, "auto", calibration, held)
    assert model.cfg.attention == target and model.cfg.n_head == source.cfg.n_head
    assert (record["method"] == "init") == (target in ("gla", "tpa_nc_a"))
    for name, tensor in model.state_dict().items():  # everything but the attention is the source's
        if ".attn." not in name:
            assert torch.equal(tensor, source.state_dict()[name]), name
    idx = held[0]
    with torch.no_grad():
        assert model(idx).shape == source(idx).shape
    errors = record["errors_start"]
    assert len(errors) == source.cfg.n_layer
    if record["method"] != "init":  # a closed form starts nearer the source than the mechanism's own init
        own_errors = convert_model(source, cfg, "init", None, held)[1]["errors_start"]
        assert all(e < o for e, o in zip(errors, own_errors)), (errors, own_errors)


def test_more_kv_heads_repeat_the_source_exactly(llama):
    _, source, _, held = llama
    model, _ = convert_model(source, target_config(source.cfg, "mha"), "auto")
    with torch.no_grad():
        torch.testing.assert_close(model(held[0]), source(held[0]), rtol=1e-5, atol=1e-5)


def test_mla_closed_form_queries_are_exact_and_its_latent_is_whitened(llama):
    _, source, calibration, _ = llama
    cfg = target_config(source.cfg, "mla", options={"kv_lora_rank": 40, "rope_dim": 12})
    model, _ = convert_model(source, cfg, "closed", calibration)
    batches = calibration_batches(source, calibration)
    rope, nope = rope_subset(24, 12)
    assert rope.tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22] and len(nope) == 12
    x = batches[0].inputs[0]  # [B, T, d] the first layer's attention input
    src, dst = source.blocks[0].attn, model.blocks[0].attn
    with torch.no_grad():
        want = src.q(x).view(*x.shape[:2], 4, 24)  # [B, T, h, d_h]
        want = torch.cat([want[..., nope], want[..., rope]], dim=-1)
        got = dst.q_up(dst.q_norm(dst.q_down(x))).view(*x.shape[:2], 4, 24)
        n = x / source.blocks[0].attn_norm.weight  # the normalized input: RMS 1 but for the source norm's eps
        rms = torch.rsqrt(n.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)[..., None]  # [B, T, 1, 1]: MLA's q_norm
        torch.testing.assert_close(got, want * rms, rtol=1e-4, atol=1e-5)
        xs = torch.cat([b.inputs[0].reshape(-1, x.shape[-1]) for b in batches])  # [N, d] every calibration input
        c = dst.kv_down(xs)[:, : dst.d_c].double()  # [N, d_c] the latent before its norm
        cov = c.T @ c / c.shape[0]  # E[c c^T] over the calibration tokens the statistics came from
    torch.testing.assert_close(cov, torch.eye(dst.d_c, dtype=cov.dtype), rtol=0, atol=1e-3)  # whitened
    assert input_statistics(batches)[0][1].shape == (64, 64)


@pytest.mark.slow  # two conversions with 20 distillation steps each (~10 s on 2 busy cores)
def test_distillation_lowers_every_layers_error(llama):
    _, source, calibration, held = llama
    # from a closed form (a small learning rate refines it) and from the mechanism's own initialization
    for target, options, lr in (("mla", {"kv_lora_rank": 16, "rope_dim": 8}, 3e-4), ("tpa_nc_a", {}, 3e-3)):
        cfg = target_config(source.cfg, target, options=options)
        _, record = convert_model(source, cfg, "auto", calibration, held, distill_steps=20, distill_lr=lr)
        before, after = record["errors_start"], record["errors_distilled"]
        assert all(a < b for a, b in zip(after, before)), (target, before, after)
        assert record["calibration_tokens"] == 6 * 4 * SEQ


def test_the_converted_checkpoint_records_source_method_tokenizer(llama, tmp_path):
    from t6.data.tokenizer import checkpoint_tokenizer, load_tokenizer
    from t6.model.load import read_checkpoint

    path, _, calibration, held = llama
    out = tmp_path / "mla.ckpt"
    convert_checkpoint(
        path,
        "mla",
        options={"kv_lora_rank": 16, "rope_dim": 8},
        out=out,
        calibration=calibration,
        held_out=held,
        distill_steps=2,
    )
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["source"]["pretrained"] == str(path.resolve()) and ckpt["source"]["attention"] == "gqa"
    assert ckpt["conversion"]["method"] == "closed" and ckpt["conversion"]["distill"]["steps"] == 2
    assert ckpt["conversion"]["calibration_tokens"] == 6 * 4 * SEQ
    assert checkpoint_tokenizer(ckpt) == load_tokenizer(path) == load_tokenizer(out)
    model = load_model(out)
    assert model.cfg.attention == "mla" and model.cfg.attention_options["q_lora_rank"] == 64
    assert read_checkpoint(out)["model_config"]["rope_remap"]["rope_type"] == "llama3"


@pytest.mark.slow  # converts through convert.py's code with MLflow, then trains twice (~25 s)
def test_a_converted_pretrained_model_trains_in_its_tokenizer_with_its_source_as_teacher(llama, make_cfg, tmp_path):
    import mlflow

    from t6.data.tokenizer import load_tokenizer
    from t6.run.train import main as train
    from t6.uptrain.job import run as convert_run

    from conftest import TEST_RUN, compose_config

    path = llama[0]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = tmp_path / "mqa.ckpt"
    conv = compose_config(
        [
            f"ckpt_path={path}",
            "target=mqa",
            f"out={out}",
            "distill_steps=3",
            "calibration_batches=2",
            "data.seq_len=32",
            "data.val_windows=4",
            f"tracking_uri={uri}",
        ],
        tmp_path,
        "convert",
    )
    lines = convert_run(conv)
    assert "validation loss: source" in "\n".join(lines)
    client = mlflow.MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("convert").experiment_id])
    by_attention = {r.data.params["attention.name"]: r for r in runs}
    assert set(by_attention) == {"gqa", "mqa"}  # the pretrained source's run beside the conversion's
    assert by_attention["mqa"].data.tags["source_run_id"] == by_attention["gqa"].info.run_id
    assert (
        "val/loss" in by_attention["mqa"].data.metrics
        and "model/kv_cache_bytes_per_token" in by_attention["mqa"].data.params
    )

    tok = load_tokenizer(path)
    run_opts = [o for o in TEST_RUN if not o.startswith("trainer.max_steps")]
    cfg = make_cfg(
        *run_opts,
        f"init_from={out}",
        f"teacher={path}",
        "trainer.max_steps=4",
        "lr_ablation.warmup_steps=1",
        "data.seq_len=64",  # the warm start's block_size is 128; size=tiny's 256 is not the model's
        "eval.limit=4",
        "eval.num_fewshot=[0]",
        "samples.max_new_tokens=4",
        small=False,
    )
    metrics, objects = train(cfg)
    assert objects["plan"].tokenizer == tok and objects["trainer"].global_step == 4
    dm = objects["datamodule"]
    assert dm.data_dir.name.endswith(tok.id.replace(":", "-"))  # the corpus tokenized in the model's tokenizer
    assert int(dm.train_windows.shards[0].max()) < tok.n_vocab
    last = torch.load(Path(objects["plan"].checkpoint_dir) / "last.ckpt", weights_only=True)
    assert last["tokenizer"]["id"] == tok.id
    run = mlflow.MlflowClient(tracking_uri=cfg.logger.mlflow.tracking_uri).get_run(objects["mlflow"].run_id)
    assert run.data.params["tokenizer/id"] == tok.id and "eval/0shot/avg" in run.data.metrics
    assert objects["samples"][0].startswith("ROMEO:")

    with pytest.raises(
        ValueError, match=r"init_from=.* uses tokenizer .* but this run \(tokenizer=gpt2\) uses tokenizer gpt2"
    ):
        from t6.run.plan import plan_run

        plan_run(make_cfg(f"init_from={out}", "tokenizer=gpt2"))
