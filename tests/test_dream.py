"""Dream (Qwen2 layout), the second model family: config detection, Qwen2 tensor names, the golden forward,
the logit alignment, the golden Dream samplers, and the official defects handled on purpose (issue #16).

Golden data: ``tests/data/dream_tiny_a`` (made by the official Polestar Dream code, CPU float32); the whole
folder is replayed by ``python -m polestar_jax.crosscheck tests/data/dream_tiny_a``."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax.decode import commit as R
from polestar_jax import crosscheck as CC
from polestar_jax.config import DecodeConfig, ModelConfig
from polestar_jax.errors import ConfigError
from polestar_jax.models.family import FAMILIES, family_of

DREAM_DIR = Path(__file__).parent / "data" / "dream_tiny_a"


def _config_dict() -> dict:
    with open(DREAM_DIR / "config.json") as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------- config
def test_config_detects_dream_and_its_fields():
    cfg = ModelConfig.from_json(str(DREAM_DIR))
    assert cfg.family == "dream" and family_of(cfg) is FAMILIES["dream"]
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers, cfg.mlp_hidden_size) == (64, 4, 2, 2, 128)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.include_qkv_bias) == (1e-6, 1e6, True)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (255, 254, 254)
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg  # the Dream config.json we write reads back


def test_config_ids_follow_the_official_sources():
    d = _config_dict()
    for k in ("mask_token_id", "eos_token_id", "pad_token_id"):
        d.pop(k)
    # mask and pad: DreamConfig's defaults; eos: generation_config.json, else pad
    cfg = ModelConfig.from_dict({**d, "vocab_size": 152064}, generation={"eos_token_id": 151645})
    assert (cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id) == (151666, 151643, 151645)
    assert ModelConfig.from_dict({**d, "vocab_size": 152064}).eos_token_id == 151643


@pytest.mark.parametrize("change, word", [({"model_type": "qwen2"}, "model_type"),
                                          ({"tie_word_embeddings": True}, "tie_word_embeddings"),
                                          ({"hidden_act": "gelu"}, "hidden_act"),
                                          ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling")])
def test_config_rejects_what_it_cannot_run(change, word):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({**_config_dict(), **change}, source="config.json")
    assert word in str(e.value) and len(str(e.value).splitlines()) == 1


# ----------------------------------------------------------------------------------------- checkpoint
def test_checkpoint_maps_qwen2_names(dream):
    from polestar_jax.io.checkpoint import hf_to_params, params_to_hf
    from polestar_jax.io.safetensors_io import read_safetensors

    cfg, params = dream
    blocks = params["blocks"]
    assert blocks["bq"].shape == (2, 64) and blocks["bk"].shape == (2, 32) and blocks["bv"].shape == (2, 32)
    assert blocks["wk"].shape == (2, 64, 32) and params["lm_head"].shape == (64, 256)
    hf = read_safetensors(str(DREAM_DIR / "model.safetensors"))
    back = params_to_hf(params, cfg)
    assert sorted(back) == sorted(hf) and "lm_head.weight" in back
    for name in back:
        np.testing.assert_array_equal(back[name], np.asarray(hf[name]), err_msg=name)
    again = hf_to_params(back, cfg)
    np.testing.assert_array_equal(again["blocks"]["bv"], np.asarray(blocks["bv"]))


def test_kv_cache_holds_the_kv_heads(dream):
    from polestar_jax.decode.layout import init_decode_state

    cfg, _ = dream
    dc = DecodeConfig(decoder="fastdllm", cache="dual", gen_length=32, block_length=16)
    s = init_decode_state(cfg, dc, [[1, 2, 3]], 16)
    assert s.k_cache.shape == (2, 1, 2, 48, 16) == s.v_cache.shape  # [N, b, KV, L, hd], KV = 2 < H = 4


# ------------------------------------------------------------------------------------------- forward
def test_golden_logits_and_hidden_states(dream, dream_cases):
    """Two short golden logits dream_cases and the hidden states (every case, up to L512: crosscheck)."""
    cfg, params = dream
    for case in dream_cases["logits_cases"]:
        if case["file"] not in ("logits_L16.npy", "logits_allmask_L24.npy"):
            continue
        ids = jnp.asarray(np.asarray(case["input_ids"], np.int32))
        out, hs = CC.family_logits(params, ids, cfg, collect_hidden=case["file"] == "logits_L16.npy")
        ref = np.load(DREAM_DIR / case["file"])
        assert CC._budget_used(np.asarray(out), ref) <= 1.0, case["file"]
        if hs is not None:
            assert case["input_ids"] == dream_cases["meta"]["hidden_states_input"]
            assert CC._budget_used(np.asarray(hs), np.load(DREAM_DIR / "hidden_states_L16.npy")) <= 1.0


def test_logit_alignment_is_the_familys(dream):
    """Dream: position p is predicted from row p-1 of the forward's input span, the span's first row twice."""
    cfg, params = dream
    fam = family_of(cfg)
    h = jax.random.normal(jax.random.PRNGKey(0), (1, 10, cfg.d_model))
    raw = np.asarray(fam.lm_head(params, h, cfg))
    np.testing.assert_array_equal(np.asarray(fam.head_at(params, h, cfg, 0, 4)), raw[:, [0, 0, 1, 2]])
    np.testing.assert_array_equal(np.asarray(fam.head_at(params, h, cfg, 5, 3)), raw[:, [4, 5, 6]])
    assert FAMILIES["llada"].logit_shift == 0 and fam.logit_shift == 1


# ------------------------------------------------------------------------------------------- samplers
@pytest.mark.parametrize("name", ["dual_nocluster_thr/p0/g64_b16_s64", "dual_nocluster_sched/p0/g64_b16_s64",
                                  "plain_thr/p0/g64_b16_s64"])
def test_golden_sampler_case(dream, dream_cases, name):
    """Output ids, NFE and the (position, token) commits of every forward, exactly (the whole set:
    crosscheck)."""
    from engines import generate  # tests/engines.py

    cfg, params = dream
    case = next(c for c in dream_cases["generate_cases"] if c["name"] == name)
    dcfg = CC.dream_decode_config(case)
    res = generate(params, cfg, [case["prompt_ids"]], dcfg, prompt_slot=16)
    r = CC._check_generation(name, res, 0, len(case["prompt_ids"]), case["generated_ids"], case["nfe"],
                             case["trajectory"], case["margins"]["commits_per_forward"], exact_trajectory=True)
    assert r.status == "pass", r.detail


def test_dream_start_commit_is_a_policy_parameter():
    with pytest.raises(ConfigError):
        DecodeConfig(decoder="fastdllm", cache="none", start_commit="first")
    with pytest.raises(ConfigError):
        DecodeConfig(decoder="fastdllm", cache="dual", threshold=0.9, schedule="timesteps")
    with pytest.raises(ConfigError):
        DecodeConfig(decoder="fastdllm", cache="dual", start_commit="everything")


def test_timestep_schedule_matches_the_reference_formula():
    ts = R.timesteps(16, 1e-3)
    assert ts.dtype == np.float32 and ts[0] == 1.0 and abs(ts[-1] - 1e-3) < 1e-9 and len(ts) == 17
    for n in (1, 7, 15, 16):
        for i in range(20):
            got = int(R.timestep_schedule(jnp.asarray([n], jnp.int32), 16, jnp.int32(i), 1e-3)[0])
            if i >= 15:
                assert got == n  # the last step (and, unlike the reference, any later one) takes them all
            else:
                assert got == int(np.float32(n) * (np.float32(1) - ts[i + 1] / ts[i]))


# ---------------------------------------------------------------------- official defects, handled
def _masky_dream(dream):
    """The golden Dream weights with the LM head turned towards the mask token (the reference's argmax
    would pick the mask everywhere and loop forever, J5)."""
    cfg, params = dream
    lm = params["lm_head"].at[:, cfg.mask_token_id].set(10.0 * jnp.abs(params["lm_head"]).max())
    return cfg, {**params, "lm_head": lm}


def test_no_endless_loop_when_the_mask_is_the_argmax(dream):
    """J5: the official loops end only when the block has no [MASK]; here the mask is never committed and
    every loop is bounded (docs/differences.md#d1)."""
    from engines import generate  # tests/engines.py

    cfg, params = _masky_dream(dream)
    dcfg = DecodeConfig(decoder="fastdllm", cache="dual", gen_length=64, block_length=16, threshold=0.9,
                        step_after_full_pass=False, start_commit="first")  # (the golden case's executable)
    res = generate(params, cfg, [[5, 6, 7]], dcfg, prompt_slot=16)
    assert (res.tokens != cfg.mask_token_id).all() and int(res.nfe[0]) <= 4 * 17


def test_no_cache_schedule_runs_where_the_reference_crashes(dream):
    """J1 / J7: the official no-cache sampler raises NameError, and with a schedule alg it indexes past its
    timesteps; here the no-cache neg-entropy schedule fills every block in ``steps_per_block`` forwards."""
    from engines import generate  # tests/engines.py

    cfg, params = dream
    dcfg = DecodeConfig(decoder="fastdllm", cache="none", gen_length=32, block_length=16, steps=16, threshold=None,
                        schedule="timesteps", rank_by="neg_entropy")
    res = generate(params, cfg, [[5, 6, 7]], dcfg, prompt_slot=16)
    assert (res.tokens != cfg.mask_token_id).all()
    assert res.block_nfe[0].tolist() == [8, 8]


def test_dream_polestar_parameters_are_family_defaults():
    from polestar_jax.api import decode_config

    pc = decode_config(family="dream", gen_length=64, block_length=16).polestar
    assert (pc.full_prefix_rows, pc.full_suffix_rows, pc.proxy_score, pc.patch_kv, pc.tie_break) == (
        64, 32, "mean", "clustered", "shared_row")
    assert pc.window_rows(16) == 96 and pc.pass_window(16, True) == (32, 16)
    assert decode_config(family="llada", gen_length=64, block_length=16).polestar == decode_config(
        gen_length=64, block_length=16).polestar
    assert decode_config(family="dream", gen_length=64, block_length=16, proxy_score="heads").polestar.proxy_score \
        == "heads"


# ------------------------------------------------------------------------------- Polestar on Dream
def test_dream_proxy_score_averages_heads_then_one_softmax(dream):
    from polestar_jax.decode.polestar import drift as Dr
    from polestar_jax.models import dream as MD

    cfg, params = dream
    lp = jax.tree.map(lambda a: a[0], params["blocks"])
    c = jax.random.normal(jax.random.PRNGKey(1), (1, 3, cfg.d_model))
    k = jax.random.normal(jax.random.PRNGKey(2), (1, cfg.n_kv_heads, 20, cfg.head_dim))
    s = np.asarray(Dr.proxy_attention(lp, c, k, cfg, None, mode="mean"))
    q = np.asarray(MD.project_q(lp, c, cfg)).mean(axis=1)  # [1, K, hd]: with the q bias, no RoPE
    logits = q @ np.asarray(k).mean(axis=1).transpose(0, 2, 1) / np.sqrt(cfg.head_dim)
    want = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(s[:, 0], want / want.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
    assert Dr.proxy_attention(lp, c, k, cfg, None).shape == (1, cfg.n_heads, 3, 20)  # LLaDA's, per head


def test_structural_tie_goes_to_the_later_position():
    conf = jnp.asarray([[0.6, 0.6, 0.3, 0.6]])
    masked = jnp.ones((1, 4), bool)
    order = np.asarray([1, 0, 2, 3])
    assert R.commit_threshold(conf, masked, 0.9).tolist() == [[True, False, False, False]]
    assert R.commit_threshold(conf, masked, 0.9, order).tolist() == [[False, True, False, False]]
    assert R.rank_desc(conf, order).tolist() == [[1, 0, 3, 2]]  # other ties: the lower position first


def test_full_pass_window_is_fixed_and_the_windowed_pass_keeps_2b_b(dream):
    from polestar_jax.decode.polestar.state import geometry
    from polestar_jax.decode.layout import init_decode_state

    cfg, _ = dream
    dcfg = DecodeConfig(decoder="polestar", gen_length=64, block_length=16, threshold=0.9,
                        polestar=FAMILIES["dream"].polestar_config())
    pc = dcfg.polestar
    state = init_decode_state(cfg, dcfg, [list(range(70))], 80)
    cs = 80 + 16  # block 1
    full = geometry(state, cs, 16, pc, window=pc.pass_window(16, False))
    win = geometry(state, cs, 16, pc, window=pc.pass_window(16, True))
    assert full.ref_pos.shape == (96,) and (int(full.pre_len[0]), int(full.suf_len[0])) == (64, 32)
    assert (int(win.pre_len[0]), int(win.suf_len[0])) == (32, 16)
    valid = np.asarray(win.ref_valid[0])
    assert not valid[:32].any() and valid[32:64].all() and valid[64:80].all() and not valid[80:].any()


def test_golden_polestar_case_with_injected_decisions(dream, dream_cases):
    """One Dream Polestar case end to end (the k-means draws, labels and cluster choices injected, the
    structural ties by rule): output ids, NFE, commits of every forward and block_stats exactly."""
    from engines import generate  # tests/engines.py

    cfg, params = dream
    case = next(c for c in dream_cases["generate_cases"] if c["name"] == "polestar/p0/g64_b16_s64")
    dcfg = CC.dream_decode_config(case, kernels="reference", refresh_buckets=1)  # (one width: a faster compile)
    replay = CC.dream_replay(str(DREAM_DIR), [case], cfg, dcfg)
    res = generate(params, cfg, [case["prompt_ids"]], dcfg, prompt_slot=16, replay=replay)
    r = CC._check_dream_polestar_case(case, res, 0)
    assert r.status == "pass", r.detail
    assert "structural ties decided as the official code: 4/4" in r.detail
