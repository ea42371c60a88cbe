"""The attention zoo against the paper: parameter-matched sizes, KV cache per token (Table 1),
RoPE compatibility, the MHA/MQA/GQA and MHA/TPA equivalences, and training of every option."""

from __future__ import annotations

import dataclasses
import math

import mlflow
import pytest
import torch

from t6.hydra_config import model_config
from t6.model import T6
from t6.model.attention import available, get_attention_class
from t6.model.facts import decode_flops_per_cached_token, kv_elements_per_token, meta_model, parameter_count
from t6.report.summary import summarize
from t6.run.train import main as train

from conftest import CONF, compose_config, random_model

ATTENTIONS = available()  # every registered mechanism; test_every_mechanism_has_a_config ties them to conf/
PAPER_PARAMS = {"small": 124e6, "medium": 353e6, "large": 773e6, "xl": 1.55e9}  # paper Table 6 / final version


@pytest.mark.parametrize("size", list(PAPER_PARAMS))
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_parameter_count_matches_paper(attention, size, tmp_path):
    model = meta_model(model_config(compose_config([f"attention={attention}", f"size={size}"], tmp_path)))
    assert model.num_params() == pytest.approx(PAPER_PARAMS[size], rel=0.01)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_tiny_heads_match_mha_parameters(attention, tmp_path):
    """Every mechanism's tiny head count gives MHA's tiny parameter count within 0.2%, or, where its
    per-head granularity cannot (GTA: 128 d_model parameters per head and layer), the nearest any
    valid head count gets."""
    mha = parameter_count(model_config(compose_config(["attention=mha", "size=tiny"], tmp_path)))
    cfg = model_config(compose_config([f"attention={attention}", "size=tiny"], tmp_path))
    gap = abs(parameter_count(cfg) / mha - 1)
    if gap > 0.002:
        others = []
        for h in range(1, 2 * cfg.n_head + 2):
            try:
                others.append(abs(parameter_count(dataclasses.replace(cfg, n_head=h)) / mha - 1))
            except ValueError:  # a head count the mechanism's options do not allow
                continue
        assert gap == min(others), f"{attention}: {cfg.n_head} heads are {gap:.2%} from MHA; a nearer count exists"


# KV cache elements per token and layer as the paper writes them (Table 1; §3.4-3.5 for the
# variants), from the heads h, the head width d and the mechanism's options o. Mechanisms the
# paper does not define (new ones) need no entry: their count is their cache_spec (facts).
TABLE_1 = {
    "mha": lambda h, d, o: 2 * h * d,
    "mqa": lambda h, d, o: 2 * d,
    "gqa": lambda h, d, o: 2 * o.n_kv_head * d,
    "mla": lambda h, d, o: o.kv_lora_rank + o.rope_dim,
    "tpa": lambda h, d, o: (o.k_rank + o.v_rank) * (h + d),
    "tpa_kvonly": lambda h, d, o: (o.k_rank + o.v_rank) * (h + d),
    "tpa_sigmoid": lambda h, d, o: (o.k_rank + o.v_rank) * (h + d),
    "tpa_softmax": lambda h, d, o: (o.k_rank + o.v_rank) * (h + d),
    "tpa_nc_a": lambda h, d, o: (o.k_rank + o.v_rank) * d,
    "tpa_nc_b": lambda h, d, o: (o.k_rank + o.v_rank) * h,
    "tpa_shared_b": lambda h, d, o: o.kv_rank * (2 * h + d),
    "tpa_third_order": lambda h, d, o: (o.k_rank + o.v_rank) * (h + d // o.c_dim + o.c_dim),
}


def test_every_mechanism_has_a_config_and_every_config_a_mechanism():
    assert sorted(p.stem for p in (CONF / "attention").glob("*.yaml")) == ATTENTIONS


@pytest.mark.parametrize("size", ["tiny", "medium"])
@pytest.mark.parametrize("attention", sorted(TABLE_1))
def test_kv_cache_per_token_is_table_1(attention, size, tmp_path):
    cfg = model_config(compose_config([f"attention={attention}", f"size={size}"], tmp_path))
    expected = TABLE_1[attention](cfg.n_head, cfg.head_dim, cfg.options())
    assert kv_elements_per_token(cfg) == expected


def test_summary_reports_the_built_model(tmp_path):
    cfg = model_config(compose_config(["attention=tpa", "size=medium"], tmp_path))
    row = summarize(cfg, "tpa", "medium", cache_dtype="bfloat16", seq_len=16)
    assert row["params"] == meta_model(cfg).num_params()
    assert row["params_non_embedding"] == row["params"] - 50304 * 1024
    assert (
        row["params_non_embedding"]
        == 24 * (row["params_attention_per_block"] + row["params_ffn_per_block"] + row["params_norms_per_block"]) + 1024
    )
    assert row["kv_cache_elements_per_token_per_layer"] == 4 * (47 + 64)
    assert row["kv_cache_bytes_per_token"] == 4 * (47 + 64) * 2 * 24
    # every matrix is counted: forward FLOPs per token are at least 2 x (parameters outside the norms)
    norms = 24 * row["params_norms_per_block"] + 1024
    assert row["flops_per_token_forward"] > 2 * (row["params"] - norms)
    assert row["flops_per_token_train"] == pytest.approx(3 * row["flops_per_token_forward"], rel=0.05)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_attention_invariant_to_position_shift(attention, tmp_path):
    """Paper Theorem 1 (and RoPE for the baselines): logits depend on relative positions only,
    so shifting every position by a constant leaves each attention layer's output unchanged."""
    model = random_model(tmp_path, f"attention={attention}")
    attn = model.blocks[0].attn
    x = torch.randn(2, 16, model.cfg.d_model)
    base = attn(x, torch.arange(16))
    torch.testing.assert_close(attn(x, torch.arange(16) + 37), base, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(attn(x.flip(1), torch.arange(16)), base.flip(1), atol=1e-3)  # order matters


def copy_shared(src: T6, dst: T6) -> None:
    """Copy every parameter whose name and shape exist in both models."""
    theirs = src.state_dict()
    dst.load_state_dict(
        {k: theirs[k] if k in theirs and theirs[k].shape == v.shape else v for k, v in dst.state_dict().items()}
    )


def test_mha_is_non_contextual_tpa_with_basis_head_factors(tmp_path):
    """§3.4.1: with R = h and A fixed to R times the identity, (1/R) A^T B(x) puts row i of
    B(x) = W x into head i, which is MHA with W_Q, W_K, W_V = the token-factor maps."""
    h = 4
    mha = random_model(tmp_path, "attention=mha", f"size.n_head={h}", seed=1)
    ranks = [f"attention.options.{r}_rank={h}" for r in "qkv"]
    tpa = random_model(tmp_path, "attention=tpa_nc_a", f"size.n_head={h}", *ranks, seed=2)
    copy_shared(mha, tpa)
    with torch.no_grad():
        for m, t in zip(mha.blocks, tpa.blocks):
            for n in "qkv":
                t.attn.ctx[n].weight.copy_(getattr(m.attn, n).weight)  # [h * d_h, d_model]: B = W x
                t.attn.const[n].weight.copy_(h * torch.eye(h))  # A = R I
            t.attn.out.weight.copy_(m.attn.out.weight)
    idx = torch.randint(0, mha.cfg.vocab_size, (2, 20))
    torch.testing.assert_close(tpa(idx), mha(idx), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        tpa.blocks[0].attn.const["v"].weight.fill_(1.0)  # non-basis head factors break the equality
    assert (tpa(idx) - mha(idx)).abs().max() > 1e-3


@pytest.mark.parametrize("kv_heads,other", [(4, "mha"), (1, "mqa")])
def test_gqa_ends_are_mha_and_mqa(kv_heads, other, tmp_path):
    ref = random_model(tmp_path, f"attention={other}", "size.n_head=4", seed=1)
    gqa = random_model(tmp_path, "attention=gqa", "size.n_head=4", f"attention.options.n_kv_head={kv_heads}", seed=2)
    assert gqa.state_dict().keys() == ref.state_dict().keys()
    gqa.load_state_dict(ref.state_dict())
    idx = torch.randint(0, ref.cfg.vocab_size, (2, 20))
    torch.testing.assert_close(gqa(idx), ref(idx), rtol=0, atol=0)
    assert gqa.build_kv_caches(1, 8)[0].elements_per_token() == ref.build_kv_caches(1, 8)[0].elements_per_token()


def test_grouped_heads_expanded_where_sdpa_cannot_broadcast_them(monkeypatch):
    """On CUDA in fp32, SDPA broadcasts grouped heads only in its math kernel ([B, h, T, T] scores):
    K/V are expanded there instead. Both forms give the same attention."""
    from t6.model.attention import base

    assert base.sdpa_broadcasts_groups("cpu", torch.float32) and base.sdpa_broadcasts_groups("cuda", torch.bfloat16)
    assert base.sdpa_broadcasts_groups("cuda", torch.float16) and not base.sdpa_broadcasts_groups("cuda", torch.float32)
    q, k, v = torch.randn(2, 6, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)  # 3 query heads per KV head
    pos = torch.arange(9)
    broadcast = base.attend(q, k, v, pos, None)  # [B, h, T, d]
    monkeypatch.setattr(base, "sdpa_broadcasts_groups", lambda device_type, dtype: False)
    torch.testing.assert_close(base.attend(q, k, v, pos, None), broadcast)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True
    )
    torch.testing.assert_close(broadcast, ref)


def test_mla_caches_latents_not_heads(tmp_path):
    model = random_model(tmp_path, "attention=mla", "size.n_head=4", "attention.options.kv_lora_rank=48")
    cache = model.build_kv_caches(1, 8)[0]
    assert {k: tuple(t.shape[2:]) for k, t in cache.tensors.items()} == {"c_kv": (48,), "k_rope": (32,)}


@pytest.mark.slow  # one train(cfg) per option: ~1 min each on a loaded 2-core CPU
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_every_option_trains(attention, make_cfg):
    cfg = make_cfg(
        f"attention={attention}",
        "trainer.max_steps=12",
        "trainer.val_check_interval=12",
        "lr_ablation.by_size.tiny.warmup_steps=3",
        "callbacks.model_checkpoint=null",
    )
    _, objects = train(cfg)
    assert objects["trainer"].global_step == 12
    client = mlflow.MlflowClient(tracking_uri=cfg.logger.mlflow.tracking_uri)
    loss = [m.value for m in client.get_metric_history(objects["mlflow"].run_id, "train/loss")]
    assert len(loss) == 12 and all(math.isfinite(v) for v in loss)
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.5, loss


@pytest.mark.parametrize(
    "attention, fused",
    [(a, False) for a in ("mha", "gqa", "mla", "tpa", "tpa_kvonly")]
    + [("mla", True), ("tpa", True), ("tpa_kvonly", True)],
)
def test_decode_flops_per_cached_token_are_the_attention_formulas(attention, fused, tmp_path, monkeypatch):
    """Counted on the mechanism's decode path, eager or through the fused operators' FLOP formulas:
    q.k and p.v per query head (4 h d_h); MLA's absorbed scores over the latent and its RoPE key plus
    the averaged latent (2h(d_c + d_rope) + 2h d_c); TPA's B_K.B_Q, then A_Q, then P A_V B_V
    (2(R_Q R_K d_h + R_Q R_K h + h R_V d_h); B_K.q per head for KVonly)."""
    cfg = model_config(compose_config([f"attention={attention}", "size=medium"], tmp_path))
    cls = get_attention_class(attention)
    if hasattr(cls, "fused_decode"):
        monkeypatch.setattr(cls, "fused_decode", fused)
    h, d, o = cfg.n_head, cfg.head_dim, cfg.options()
    if attention == "mla":
        expected = 2 * h * (o.kv_lora_rank + o.rope_dim) + 2 * h * o.kv_lora_rank
    elif attention == "tpa":
        expected = 2 * (o.q_rank * o.k_rank * d + o.q_rank * o.k_rank * h + h * o.v_rank * d)
    elif attention == "tpa_kvonly":
        expected = 2 * (o.k_rank * d * h + h * o.v_rank * d)
    else:
        expected = 4 * h * d
    assert decode_flops_per_cached_token(cfg) == expected
