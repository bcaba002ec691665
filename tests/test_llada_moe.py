"""LLaDA-MoE, the mixture-of-experts family (issue #45): config detection from ``architectures``, the HF tensor
names with stacked experts, the golden forward (logits, hidden states, every router choice), the grouped
``ragged_dot`` experts against a dense all-experts reference, the 27 golden no-cache generations through the
engine, exact properties of the cached decoders (no reference has a KV cache for this model), and the memory
plan at LLaDA-MoE-7B-A1B's shapes.

Golden data: ``tests/data/llada_moe_tiny_a`` (the HF remote code ``modeling_lladamoe.py``, CPU float32; its
config.json has no mask id, like the real one: the mask id comes from ``cases.json -> model``). The whole folder
is replayed by ``python -m polestar_jax.crosscheck tests/data/llada_moe_tiny_a``."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax import crosscheck as CC
from polestar_jax.config import DecodeConfig, ModelConfig
from polestar_jax.errors import ConfigError
from polestar_jax.models import llada_moe
from polestar_jax.models.family import FAMILIES, family_of

MOE_DIR = Path(__file__).parent / "data" / "llada_moe_tiny_a"
MOE_7B_CONFIG = Path(__file__).parent / "data" / "llada_moe_7b_a1b" / "config.json"
SLOT = 48  # one prompt slot for every generation here (prompts of 12 / 25 / 41 tokens)
_FUNCTIONS = {"llada.generate": "llada", "fastdllm.generate": "fastdllm"}


def _config_dict() -> dict:
    with open(MOE_DIR / "config.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def cases() -> dict:
    with open(MOE_DIR / "cases.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def moe(cases):
    """(cfg, params) of the golden folder in float32, the mask id from ``cases.json``."""
    from polestar_jax.io.checkpoint import load_model

    cfg = ModelConfig.from_dict({**_config_dict(), "mask_token_id": cases["model"]["mask_token_id"]})
    return load_model(str(MOE_DIR), dtype="float32", config=cfg)


def _decode_config(case: dict) -> DecodeConfig:
    """The DecodeConfig of one golden ``generate_cases`` entry (written here, independent of crosscheck)."""
    s = case["settings"]
    assert s["temperature"] == 0.0 and s["remasking"] == "low_confidence" and not s.get("logits_eos_inf")
    return DecodeConfig(decoder=_FUNCTIONS[case["function"]], cache="none", gen_length=s["gen_length"],
                        block_length=s["block_length"], steps=s["steps"], threshold=s.get("threshold"),
                        early_exit=False)


# ------------------------------------------------------------------------------------------- config
def test_config_detected_from_architectures(moe):
    cfg, _ = moe
    assert cfg.family == "llada_moe" and family_of(cfg) is FAMILIES["llada_moe"]
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers, cfg.mlp_hidden_size) == (64, 4, 4, 2, 32)
    assert (cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.qk_norm, cfg.moe.norm_topk_prob) == (8, 2, True, True)
    assert (cfg.rope_theta, cfg.rms_norm_eps) == (50000.0, 1e-5)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (255, 252, 252)
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg  # the config.json we write reads back
    # the mask id need not be the top of the vocabulary; without one (and a vocabulary too small for
    # LLaDA-MoE's 156895) the config is refused in one line
    assert ModelConfig.from_dict({**_config_dict(), "mask_token_id": 100}).mask_token_id == 100
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(_config_dict(), source="config.json")
    assert "mask_token_id" in str(e.value) and len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("change, word", [
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ({"moe_layer_freq": [1, 0]}, "moe_layer_freq"),
    ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"clip_qkv": 8.0}, "clip_qkv"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"rope_theta": None}, "rope_theta"),
    ({"rope_theta": -1}, "rope_theta")])
def test_config_rejects_what_the_reference_would_run_differently(change, word):
    d = {**_config_dict(), "mask_token_id": 255, **change}
    if change.get("rope_theta", 0) is None:
        d.pop("rope_theta")
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(d, source="config.json")
    assert word in str(e.value) and len(str(e.value).splitlines()) == 1


def test_real_config_and_memory_plan_count_every_expert():
    """LLaDA-MoE-7B-A1B (MOE_SPEC.md section 1): its ids (the config has no mask id: the tokenizer's 156895)
    and a memory plan whose parameters are all 64 experts of every layer, 7.36B in all."""
    from polestar_jax.engine.plan import plan

    cfg = ModelConfig.from_json(str(MOE_7B_CONFIG))
    assert cfg.family == "llada_moe" and (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        156895, 156892, 156892)
    d, n, e, f, v, hd = cfg.d_model, cfg.n_layers, cfg.moe.n_experts, cfg.mlp_hidden_size, cfg.vocab_size, 128
    per_layer = 4 * d * d + 2 * d + 2 * hd + d * e + e * 3 * d * f  # attention, norms, q/k-norm, router, experts
    n_params = 2 * v * d + d + n * per_layer
    assert abs(n_params / 7.36e9 - 1) < 0.001
    dc = DecodeConfig(decoder="polestar", gen_length=256, block_length=32)
    mp = plan(cfg, dc, batch=2, prompt_len=128, dtype="bfloat16", compile_step=False)
    assert mp.param_bytes == 2 * n_params
    assert mp.kv_bytes_per_seq == 2 * n * 16 * hd * (128 + 256) * 2  # 16 KV heads of 128, bf16


# ----------------------------------------------------------------------------------------- checkpoint
def test_checkpoint_stacks_the_experts(moe):
    from polestar_jax.io.checkpoint import hf_to_params, params_to_hf
    from polestar_jax.io.safetensors_io import read_safetensors

    cfg, params = moe
    b = params["blocks"]
    assert b["e_gate"].shape == (2, 8, 64, 32) == b["e_up"].shape and b["e_down"].shape == (2, 8, 32, 64)
    assert b["router"].shape == (2, 64, 8) and b["q_norm"].shape == (2, 16) == b["k_norm"].shape
    assert "w_gate" not in b
    hf = read_safetensors(str(MOE_DIR / "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(b["e_down"][1, 5]), np.asarray(hf["model.layers.1.mlp.experts.5.down_proj.weight"]).T)
    back = params_to_hf(params, cfg)
    assert sorted(back) == sorted(hf)
    for name in back:
        np.testing.assert_array_equal(back[name], np.asarray(hf[name]), err_msg=name)
    again = hf_to_params(back, cfg)
    np.testing.assert_array_equal(again["blocks"]["e_gate"], np.asarray(b["e_gate"]))


# ------------------------------------------------------------------------------------------- forward
def test_golden_logits_hidden_states_and_router(moe, cases):
    """The golden logits cases (but L200: crosscheck) within the README's tolerance, the per-layer hidden
    states, and every token's expert set in every layer (router logits too) equal to the reference's."""
    cfg, params = moe
    run = jax.jit(CC.family_logits, static_argnums=(2, 3))
    for case in cases["logits_cases"]:
        if case["name"] == "logits_L200":
            continue
        ids = jnp.asarray(np.asarray(case["input_ids"], np.int32))
        out, hs = run(params, ids, cfg, "hidden_states_file" in case)
        assert CC._budget_used(np.asarray(out), np.load(MOE_DIR / case["file"])) <= 1.0, case["name"]
        if hs is not None:
            assert CC._budget_used(np.asarray(hs), np.load(MOE_DIR / case["hidden_states_file"])) <= 1.0
        if "router_file" in case:
            ref = np.load(MOE_DIR / case["router_file"])
            logits, idx, weight = (np.asarray(a) for a in jax.jit(llada_moe.routing, static_argnums=2)(
                params, ids, cfg))
            np.testing.assert_array_equal(np.sort(idx, -1), np.sort(ref["selected_experts"], -1))
            np.testing.assert_array_equal(idx, ref["selected_experts"])  # (also in the same, descending order)
            assert CC._budget_used(logits, ref["router_logits"]) <= 1.0
            np.testing.assert_allclose(weight, ref["routing_weights"], rtol=1e-5, atol=1e-6)
            assert (weight.sum(-1) < 1).all()  # raw top-k probabilities: not renormalised


def _dense_moe(lp, xn, cfg):
    """Reference MoE block: every expert on every token, weighted by the one-hot top-k routing weights."""
    b, t, d = xn.shape
    x = xn.reshape(-1, d)
    probs = jax.nn.softmax((x @ lp["router"]).astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, cfg.moe.top_k)
    coef = jnp.einsum("mk,mke->me", w.astype(x.dtype), jax.nn.one_hot(idx, cfg.moe.n_experts, dtype=x.dtype))
    hid = jax.nn.silu(jnp.einsum("md,edf->mef", x, lp["e_gate"])) * jnp.einsum("md,edf->mef", x, lp["e_up"])
    return jnp.einsum("me,med->md", coef, jnp.einsum("mef,efd->med", hid, lp["e_down"])).reshape(b, t, d)


def test_grouped_experts_equal_the_dense_reference(moe):
    """The ragged_dot MoE block == every expert on every token (values and gradients), under a vmap over rows
    too (the running batch's per-row program), and its expert groups hold exactly top_k * tokens rows."""
    cfg, params = moe
    lp = jax.tree.map(lambda a: a[1], params["blocks"])
    xn = jax.random.normal(jax.random.PRNGKey(3), (3, 40, cfg.d_model))
    got = np.asarray(jax.jit(llada_moe.moe_mlp, static_argnums=2)(lp, xn, cfg))
    want = np.asarray(jax.jit(_dense_moe, static_argnums=2)(lp, xn, cfg))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    rows = jax.jit(jax.vmap(lambda r: llada_moe.moe_mlp(lp, r[None], cfg)[0]))(xn)
    np.testing.assert_allclose(np.asarray(rows), got, rtol=1e-5, atol=2e-6)
    loss = lambda fn: (lambda p: jnp.sum(fn(p, xn, cfg) ** 2))
    g_got = jax.jit(jax.grad(loss(llada_moe.moe_mlp)))(lp)
    g_want = jax.jit(jax.grad(loss(_dense_moe)))(lp)
    for k in ("e_gate", "e_up", "e_down", "router"):
        np.testing.assert_allclose(np.asarray(g_got[k]), np.asarray(g_want[k]), rtol=1e-4, atol=1e-5, err_msg=k)
    jaxpr = str(jax.make_jaxpr(lambda x: llada_moe.moe_mlp(lp, x, cfg))(xn))
    assert jaxpr.count("ragged_dot_general") == 3  # one grouped matmul per projection


def test_norm_topk_prob_is_ignored_with_a_warning(moe):
    cfg, params = moe
    lp = jax.tree.map(lambda a: a[0], params["blocks"])
    xn = jax.random.normal(jax.random.PRNGKey(4), (1, 8, cfg.d_model))
    with pytest.warns(UserWarning, match="norm_topk_prob"):
        on = llada_moe.moe_mlp(lp, xn, cfg)
    off_cfg = ModelConfig.from_dict({**cfg.to_hf_dict(), "norm_topk_prob": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off = llada_moe.moe_mlp(lp, xn, off_cfg)
    np.testing.assert_array_equal(np.asarray(on), np.asarray(off))


# ------------------------------------------------------------------------------------------- samplers
@pytest.fixture(scope="module")
def golden_runs(moe, cases):
    """Case name -> (GenerateResult, row): the 27 golden cases, the 3 prompts of each setting as one batch."""
    from engines import generate  # tests/engines.py

    cfg, params = moe
    groups: dict = {}
    for c in cases["generate_cases"]:
        groups.setdefault(_decode_config(c), []).append(c)
    out = {}
    for dcfg, group in groups.items():
        res = generate(params, cfg, [c["prompt_ids"] for c in group], dcfg, prompt_slot=SLOT)
        out.update({c["name"]: (res, r) for r, c in enumerate(group)})
    return out


def test_golden_generations_through_the_engine(cases, golden_runs):
    """All 27 LLaDA and Fast-dLLM (no cache) cases: output ids, NFE, commits per forward and the (position,
    token) commits of every forward exactly."""
    failed = []
    for c in cases["generate_cases"]:
        res, row = golden_runs[c["name"]]
        r = CC._check_generation(c["name"], res, row, len(c["prompt_ids"]), c["generated_ids"], c["nfe"],
                                 c["trajectory"], c["margins"]["commits_per_forward"], exact_trajectory=True)
        if r.status != "pass":
            failed.append(f"{c['name']}: {r.detail}")
    assert len(cases["generate_cases"]) == 27 and failed == []


def test_refreshed_dual_cache_step_equals_the_no_cache_forward(moe, cases):
    """Along a golden no-cache trajectory, a dual-cache decode step whose cache was refreshed at that step
    (every layer's K/V from a plain pass over the current tokens) gives the plain forward's block logits, and
    so the threshold rule commits exactly the golden (position, token) pairs of every forward: a dual cache
    refreshed at every step is the no-cache decoder. (At a block start the cached decoders run that plain pass.)"""
    cfg, params = moe
    fam = family_of(cfg)
    case = next(c for c in cases["generate_cases"] if c["name"] == "fastdllm.generate/p1/g64_b16_s64/thr_0.9")
    p, blk, mask = len(case["prompt_ids"]), 16, cfg.mask_token_id
    x = np.asarray(case["prompt_ids"] + [mask] * 64, np.int32)[None]
    pos = jnp.arange(x.shape[1], dtype=jnp.int32)[None]

    @jax.jit
    def plain(ids):
        out = fam.forward(params, ids, cfg, pos, pos, None)
        return fam.lm_head(params, out.h, cfg), out.kv

    @jax.jit
    def cached(ids, kv, cs):
        q_pos = cs + jnp.arange(blk, dtype=jnp.int32)[None]
        out = fam.forward(params, jax.lax.dynamic_slice_in_dim(ids, cs, blk, axis=1), cfg, q_pos, pos, None,
                          cache=kv, start=cs)
        return fam.lm_head(params, out.h, cfg)

    worst = 0.0
    for commits in case["trajectory"]:
        cs = p + (commits[0][0] - p) // blk * blk
        logits, kv = plain(jnp.asarray(x))
        step = np.asarray(cached(jnp.asarray(x), kv, jnp.int32(cs)))[0]  # [blk, V]
        ref = np.asarray(logits)[0, cs:cs + blk]
        worst = max(worst, CC._budget_used(step, ref))
        probs = np.exp(step - step.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        conf = np.where(x[0, cs:cs + blk] == mask, probs.max(-1), -np.inf)
        take = (conf >= 0.9) | (np.arange(blk) == np.argmax(conf))
        got = sorted((cs + i, int(step[i].argmax())) for i in np.nonzero(take)[0])
        assert got == sorted(map(tuple, commits))
        for q, tok in got:
            x[0, q] = tok
    assert worst <= 0.5  # the cached rows' logits agree to rounding (a quarter of the golden tolerance)


@pytest.fixture(scope="module")
def cached_runs(moe, cases):
    """Decoder name -> (dcfg, result, permuted result) for the cached decoders at g64 b16 threshold 0.9: the
    three prompts as one batch, and the same prompts in another order (each keeping its random row key), which
    runs the same executable."""
    from engines import generate  # tests/engines.py

    cfg, params = moe
    prompts = cases["prompts"]
    common = dict(gen_length=64, block_length=16, threshold=0.9)
    polestar = FAMILIES["llada_moe"].polestar_config(refresh_buckets=1)  # (one refresh width: a faster compile)
    out = {}
    for name, dcfg in (("prefix", DecodeConfig(decoder="fastdllm", cache="prefix", **common)),
                       ("dual", DecodeConfig(decoder="fastdllm", cache="dual", **common)),
                       ("polestar", DecodeConfig(decoder="polestar", polestar=polestar, **common))):
        res = generate(params, cfg, prompts, dcfg, prompt_slot=SLOT)
        perm = generate(params, cfg, [prompts[i] for i in PERM], dcfg, prompt_slot=SLOT, rows=PERM)
        out[name] = (dcfg, res, perm)
    return out


PERM = [2, 0, 1]


@pytest.mark.parametrize("name", ["prefix", "dual", "polestar"])
def test_cached_decoders_rows_do_not_depend_on_the_batch(cached_runs, moe, name):
    """Prefix cache, dual cache and Polestar on MoE: each row (mixed prompt lengths, left padding) decodes the
    same tokens with the same commits and NFE whichever rows share its batch and at whichever position
    (batch == alone: the experts see other tokens, and no token's output depends on them); every position
    is decoded."""
    cfg, _ = moe
    _, res, perm = cached_runs[name]
    for j, r in enumerate(PERM):
        np.testing.assert_array_equal(perm.tokens[j], res.tokens[r])
        assert int(perm.nfe[j]) == int(res.nfe[r]) and perm.trajectory(j) == res.trajectory(r)
    assert not (res.tokens == cfg.mask_token_id).any()


def test_polestar_refreshes_and_saves_forwards_on_moe(cached_runs, golden_runs):
    """Polestar on MoE runs its refresh steps (the refreshed rows go through the router and experts) and needs
    fewer forwards than the no-cache decoder on the same prompts."""
    _, res, _ = cached_runs["polestar"]
    assert int(res.polestar["refresh_steps"].sum()) > 0
    plain = [golden_runs[f"fastdllm.generate/p{i}/g64_b16_s64/thr_0.9"] for i in range(3)]
    assert all(int(res.nfe[i]) < int(ref.nfe[row]) for i, (ref, row) in enumerate(plain))


def test_running_batch_equals_the_fixed_batch(cached_runs, moe, cases):
    """Continuous batching on MoE (two slots for three prompts: a per-row vmapped block program, where the
    grouped experts fold the mapped rows into their tokens) gives the fixed batch's tokens and NFE (dual
    cache; Polestar's running-batch program takes half a minute to compile on the CPU)."""
    import dataclasses

    from engines import engine_for  # tests/engines.py

    cfg, params = moe
    dcfg, res, _ = cached_runs["dual"]
    job = engine_for(params, cfg).generate(cases["prompts"], dataclasses.replace(dcfg, early_exit=False),
                                          batch_size=2, prompt_slot=SLOT)
    for r, row in enumerate(job.rows):
        np.testing.assert_array_equal(row.tokens, res.tokens[r])
        assert row.nfe == int(res.nfe[r])


_MESH_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
jax.config.update("jax_default_matmul_precision", "highest")
from polestar_jax import sharding
from polestar_jax.config import ModelConfig
from polestar_jax.io.checkpoint import load_model
from polestar_jax.models.family import family_of
folder = sys.argv[1]
cases = json.load(open(folder + "/cases.json"))
cfg = ModelConfig.from_dict({**json.load(open(folder + "/config.json")), "mask_token_id": 255})
mesh = sharding.make_mesh("data=2,model=4")
_, sharded = load_model(folder, dtype="float32", config=cfg, shardings=mesh)  # built shard by shard
_, single = load_model(folder, dtype="float32", config=cfg)
assert sharded["blocks"]["e_gate"].sharding.spec == P(None, "model", None, None)
assert sharded["blocks"]["e_down"].addressable_shards[0].data.shape == (2, 2, 32, 64)  # 8 experts / 4 devices
assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)))
case = next(c for c in cases["logits_cases"] if c["name"] == "logits_B2_L48")
ids = np.asarray(case["input_ids"], np.int32)
fam = family_of(cfg)
fn = jax.jit(lambda p, i: fam.logits(p, i, cfg))
one = np.asarray(fn(single, jnp.asarray(ids)))
many = np.asarray(fn(sharded, jax.device_put(ids, NamedSharding(mesh, P("data", None)))))
print(json.dumps({"max_abs": float(np.abs(one - many).max()), "argmax_equal": bool((one.argmax(-1) == many.argmax(-1)).all())}))
"""


def test_experts_sharded_over_the_model_axis_answer_as_one_device(subprocess_env):
    """On 8 simulated CPU devices (mesh data=2 x model=4): the experts are split over ``model`` (two whole
    experts per device), loaded shard by shard bit-identical to the unsharded load, and a batch sharded over
    ``data`` gives one device's logits."""
    import os
    import subprocess
    import sys

    env = dict(subprocess_env, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(MOE_DIR)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["argmax_equal"] and out["max_abs"] <= 1e-4, out
