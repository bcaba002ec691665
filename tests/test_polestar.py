"""Polestar end to end: exact replay of the PyTorch reference, determinism, robustness, invariants."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax import crosscheck
from polestar_jax.io.checkpoint import load_model
from polestar_jax.config import DecodeConfig, PolestarConfig
from engines import generate  # tests/engines.py
from polestar_jax.errors import ConfigError

DATA = os.path.join(os.path.dirname(__file__), "data", "polestar_tiny_p")


@pytest.fixture(scope="module")
def tiny_p():
    jax.config.update("jax_default_matmul_precision", "highest")
    return load_model(DATA, dtype="float32")


def test_golden_replay_all_methods(tiny_p):
    """Every case of every method reproduces output ids, NFE and block_stats (Polestar with the
    reference's k-means draws/labels and cluster selections injected)."""
    cfg, params = tiny_p
    results = crosscheck.replay_polestar_folder(DATA, params, cfg)
    runs = crosscheck.polestar_run_files(DATA)
    n_cases = sum(len(json.load(open(p))["cases"]) for p, _ in runs)
    assert len(results) == n_cases == 16
    failed = [f"{r.name}: {r.detail}" for r in results if r.status != "pass"]
    assert not failed, failed
    # own cluster choices differ from the injected ones only inside near-ties (spec J14)
    for r in results:
        if "cluster choice differed" in r.detail:
            gap = float(r.detail.rsplit("gap ", 1)[1].rstrip(")"))
            assert gap < 1e-4, r.detail


def _pcfg(**kw):
    base = dict(decoder="polestar", cache="dual", gen_length=32, block_length=8, threshold=0.9)
    base.update(kw)
    return DecodeConfig(**base)


def test_same_seed_same_output_and_stats_consistent(tiny_p):
    cfg, params = tiny_p
    prompt = [5, 17, 33, 2, 99, 140, 7, 61, 8, 200, 13, 4]
    dc = _pcfg()
    a = generate(params, cfg, [prompt], dc, seed=3)
    b = generate(params, cfg, [prompt], dc, seed=3)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.nfe, b.nfe)
    assert (a.tokens != cfg.mask_token_id).all()
    stats = a.block_stats(0)
    assert sum(s["block_nfe"] for s in stats) == int(a.nfe[0])
    for s in stats:
        assert s["block0_true"] + s["efficient_true"] == 1
        assert 0 <= s["cluster_true"] <= s["block_nfe"] - 1
    # blocks b % 4 == 3 start with the windowed pass
    assert [s["efficient_true"] for s in stats] == [int(s["block_id"] % 4 == 3) for s in stats]
    # the commits of every forward (threshold, early, suffix) add up to the generated tokens
    assert sum(a.commits_per_forward(0)) == dc.gen_length


def test_step_out_invariants(tiny_p):
    cfg, params = tiny_p
    prompt = list(range(3, 15))  # same shapes as the test above: no new compilation
    dc = _pcfg(gen_length=32, block_length=8)
    res = generate(params, cfg, [prompt], dc, seed=0)
    pc = dc.polestar
    for st in res.steps:
        act = st.active[:, 0]
        # inactive entries are empty; early commits only where the threshold rule did not commit
        assert not (st.commit_threshold[~act].any() or st.commit_early[~act].any())
        assert not (st.commit_threshold & st.commit_early).any()
        for i in np.nonzero(act)[0]:
            nsel = st.selected[i, 0].sum(axis=-1)
            if st.cluster[i, 0]:
                assert (nsel[:-1] <= pc.top_k).all() and nsel[-1] <= pc.top_k_last
                assert st.commit_threshold[i, 0].any()  # the most confident token always commits
            else:
                assert nsel.sum() == 0 and st.refreshed_rows[i, 0].sum() == 0
            # without replay, the selection is our own choice
            np.testing.assert_array_equal(st.selected[i, 0], st.own_selected[i, 0])
    assert res.polestar["early"][0] == sum(int(st.commit_early[:, 0].sum()) for st in res.steps)
    assert res.polestar["suffix"][0] == sum(int(st.commit_suffix[:, 0].sum()) for st in res.steps)


@pytest.mark.parametrize("prompt_len,gen,block", [(1, 8, 8), (3, 16, 8), (5, 8, 8)])
def test_short_prompts_and_single_block(tiny_p, prompt_len, gen, block):
    """Windows shorter than the cluster count, a single block (no suffix window): no crash, no NaN, the
    whole generation is filled."""
    cfg, params = tiny_p
    prompt = [(7 * i + 3) % 250 for i in range(prompt_len)]
    res = generate(params, cfg, [prompt], _pcfg(gen_length=gen, block_length=block), seed=1)
    assert (res.tokens != cfg.mask_token_id).all()
    assert 1 <= int(res.nfe[0]) <= gen + gen // block
    for st in res.steps:
        assert np.isfinite(st.token_drift).all()


def test_model_predicting_the_mask_terminates(tiny_p):
    """J1: a model whose top prediction is always the mask token must still finish every block."""
    cfg, params = tiny_p
    head = params["lm_head"].at[:, cfg.mask_token_id].set(100.0)
    bad = dict(params, lm_head=head)
    res = generate(bad, cfg, [[1, 2, 3, 4, 5, 6, 7, 8, 9]], _pcfg(gen_length=16, block_length=8))
    assert (res.tokens != cfg.mask_token_id).all()
    assert int(res.nfe[0]) <= 16 + 2


def test_config_validation():
    with pytest.raises(ConfigError):
        PolestarConfig(top_k=-1)
    with pytest.raises(ConfigError):
        PolestarConfig(windowed_period=1)
    with pytest.raises(ConfigError):
        PolestarConfig(early_threshold=1.5)
    with pytest.raises(ConfigError):
        DecodeConfig(decoder="polestar", cache="prefix")
    with pytest.raises(ConfigError):
        DecodeConfig(decoder="polestar", threshold=None)
    assert PolestarConfig() == PolestarConfig(n_clusters=8, prefix_blocks=2, suffix_blocks=1, top_k=4,
                                              top_k_last=1, history=5, early_threshold=0.7,
                                              windowed_period=4)


def test_interpret_kernels_match_reference_on_bundled_model():
    """The Pallas kernels (in the interpreter) and the jnp references decode identically. (One refresh width:
    every kernel still runs -- the row gather / scatter at width R -- and the interpreted kernels of every
    width branch would dominate this test's time; widths do not change tokens: tests/test_refresh.py.)"""
    from polestar_jax.io.tokenizer import asset_model_dir, load_tokenizer

    folder = asset_model_dir("tiny_random")  # its flat predictions make the refresh trigger
    cfg, params = load_model(folder)
    ids = load_tokenizer(folder).chat_prompt_ids("Hello")
    out = {}
    for kind in ("reference", "interpret"):
        dc = _pcfg(gen_length=16, block_length=8, polestar=PolestarConfig(kernels=kind, refresh_buckets=1))
        out[kind] = generate(params, cfg, [ids], dc, seed=0)
    np.testing.assert_array_equal(out["reference"].tokens, out["interpret"].tokens)
    np.testing.assert_array_equal(out["reference"].nfe, out["interpret"].nfe)
    assert out["reference"].block_stats(0) == out["interpret"].block_stats(0)
    assert int(out["reference"].polestar["refresh_steps"].sum()) > 0  # the refresh path ran


def test_cluster_ranking_ignores_rounding_noise():
    """Scores that differ only by float rounding (clusters of identical rows, docs/differences.md#d3) rank
    as ties wherever their values lie, so the lowest index wins whatever the noise; real differences keep
    their order; invalid slots never win."""
    from polestar_jax.decode.polestar import step as polestar_step

    SCORE_TIE_RTOL = polestar_step.SCORE_TIE_RTOL
    tie_groups = jax.jit(polestar_step.tie_groups)  # one compile per shape (eager ops compile one by one)
    top_clusters = jax.jit(polestar_step.top_clusters, static_argnums=2)

    base = np.float32(0.026051471)
    noisy = np.array([base * (1 - 3e-7), base, base * (1 + 2e-7)], np.float32)
    # a structural tie at mesh-level noise (2e-5 relative), placed on every offset of a 2**-15 grid: it is
    # one group wherever it lies (a rounding-bucket rule splits some of these)
    c = (0.5 * (1 + np.linspace(0.0, 2.0 ** -15, 9)))[:, None]  # one row per offset
    tie = (c * np.array([[1 - 1e-5, 1.0, 1 + 1e-5, 0.9]])).astype(np.float32)
    assert np.asarray(tie_groups(jnp.asarray(tie))).tolist() == [[0, 0, 0, 1]] * 9
    # groups: descending, cut where neighbours differ by more than the tolerance; infinities apart
    x = np.array([[1.0, 1.0 + 4 * SCORE_TIE_RTOL, 0.5, -np.inf, np.inf, 3e-30, -np.inf]], np.float32)
    assert np.asarray(tie_groups(jnp.asarray(x)))[0].tolist() == [2, 1, 3, 5, 0, 4, 5]
    # a chain of neighbours each within the tolerance is one group (the order inside it is by index)
    step = np.float32(1 - 0.6 * SCORE_TIE_RTOL)
    chain = np.array([[step ** 3, step ** 2, step, 1.0, 0.5]], np.float32)
    assert np.asarray(tie_groups(jnp.asarray(chain)))[0].tolist() == [0, 0, 0, 0, 1]
    # two rows: the same near-tied scores in a different rounding order pick the same clusters
    s = jnp.asarray([[5.0, noisy[0], noisy[1], noisy[2], 0.001], [5.0, noisy[2], noisy[0], noisy[1], 0.001]])
    sel = np.asarray(top_clusters(s, jnp.asarray([5, 5]), 3))
    assert sel[0].tolist() == sel[1].tolist() == [True, True, True, False, False]
    sel = np.asarray(top_clusters(s, jnp.asarray([2, 5]), 3))  # row 0 has 2 valid slots
    assert sel[0].tolist() == [True, True, False, False, False]
    # a real difference above the tolerance keeps its order: the later, larger score wins
    s = jnp.asarray([[1.0, 1.0 + 8 * SCORE_TIE_RTOL, 0.1]], jnp.float32)
    assert np.asarray(top_clusters(s, jnp.asarray([3]), 1))[0].tolist() == [False, True, False]

