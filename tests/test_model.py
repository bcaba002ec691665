"""The LLaDA forward pass: golden logits / hidden states, padding invariance, GQA, bfloat16."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax import model as M
from polestar_jax.config import ModelConfig

TINY_A_DIR = Path(__file__).parent / "data" / "llada_tiny_a"

ATOL = RTOL = 1e-4  # golden tolerance: |a - b| <= 1e-4 + 1e-4 * |ref|


def _assert_golden(out: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert out.dtype == np.float32, (what, out.dtype)
    excess = np.abs(out - ref) - (ATOL + RTOL * np.abs(ref))
    bad = np.argwhere(excess > 0)
    assert bad.size == 0, (f"{what}: {len(bad)} entries outside 1e-4 + 1e-4*|ref|, first at {tuple(bad[0])}: "
                           f"ours {out[tuple(bad[0])]} vs reference {ref[tuple(bad[0])]}")


def _logits_case_names():
    with open(TINY_A_DIR / "cases.json") as f:
        return [c["name"] for c in json.load(f)["logits_cases"]]


# --------------------------------------------------------------------------------------------- golden
@pytest.mark.parametrize("name", _logits_case_names())
def test_golden_logits(tiny_a, tiny_a_cases, name):
    cfg, params = tiny_a
    case = next(c for c in tiny_a_cases["logits_cases"] if c["name"] == name)
    ids = np.asarray(case["input_ids"], np.int32)
    ref = np.load(TINY_A_DIR / case["file"])
    out = np.asarray(M.logits_full(params, jnp.asarray(ids), cfg))
    _assert_golden(out, ref, name)
    if "argmax" in case:
        np.testing.assert_array_equal(out.argmax(-1), np.asarray(case["argmax"]))


def test_golden_hidden_states(tiny_a, tiny_a_cases):
    cfg, params = tiny_a
    case = next(c for c in tiny_a_cases["logits_cases"] if c.get("hidden_states_file"))
    assert case["hidden_states_file"] == "hidden_states_L16.npy"
    ref = np.load(TINY_A_DIR / case["hidden_states_file"])
    hs = np.asarray(M.hidden_states(params, jnp.asarray(np.asarray(case["input_ids"], np.int32)), cfg))
    assert hs.shape == (cfg.n_layers + 1, 1, 16, cfg.d_model) == ref.shape
    for i in range(hs.shape[0]):
        _assert_golden(hs[i], ref[i], f"hidden state {i}")


# ----------------------------------------------------------------------------------- padding invariance
def _padded_logits(params, cfg, rows: list[np.ndarray], pad_id: int) -> tuple[np.ndarray, list[int]]:
    """Left-pads ``rows`` to one length, runs ``forward`` with shifted positions and a key mask."""
    length = max(len(r) for r in rows) + 5  # every row gets some padding
    ids = np.full((len(rows), length), pad_id, np.int32)
    pads = []
    for i, r in enumerate(rows):
        pads.append(length - len(r))
        ids[i, pads[-1]:] = r
    pos = np.arange(length, dtype=np.int32)[None, :] - np.asarray(pads, np.int32)[:, None]
    valid = pos >= 0
    out = M.forward(params, jnp.asarray(ids), cfg, jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(valid))
    return np.asarray(M.lm_head(params, out.h, cfg)), pads


def test_left_padding_with_key_mask_is_invisible(tiny_a, tiny_a_cases):
    cfg, params = tiny_a
    case = next(c for c in tiny_a_cases["logits_cases"] if c["name"] == "logits_B2_L48")
    a = np.asarray(case["input_ids"][0], np.int32)  # 48 tokens
    b = np.asarray(case["input_ids"][1][:29], np.int32)  # a shorter row: 24 pads in the batch
    padded, pads = _padded_logits(params, cfg, [a, b], pad_id=cfg.pad_token_id)
    for row, (toks, pad) in enumerate(zip([a, b], pads)):
        alone = np.asarray(M.logits_full(params, jnp.asarray(toks[None]), cfg))[0]
        np.testing.assert_allclose(padded[row, pad:], alone, rtol=0, atol=1e-5,
                                   err_msg=f"row {row} (padding {pad})")
    # The pad tokens' identity must not matter either (they are hidden, not just "pad-like").
    other, _ = _padded_logits(params, cfg, [a, b], pad_id=7)
    np.testing.assert_allclose(other[1, pads[1]:], padded[1, pads[1]:], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------ GQA, numpy reference
def _np_rms(x, w, eps):
    x = x.astype(np.float32).astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _np_rope(t, pos, theta):
    """Rotate-half RoPE. t: [H, T, hd]; pos: [T]."""
    hd = t.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    ang = np.concatenate([ang, ang], axis=-1)
    rot = np.concatenate([-t[..., hd // 2:], t[..., : hd // 2]], axis=-1)
    return t * np.cos(ang) + rot * np.sin(ang)


def _np_layer(lp, h, cfg, pos, valid):
    """One LLaDA layer for one sequence, float64, K/V heads repeated explicitly. h: [T, D]."""
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    T = h.shape[0]
    xn = _np_rms(h, lp["attn_norm"], cfg.rms_norm_eps)
    q = (xn @ lp["wq"]).reshape(T, H, hd).transpose(1, 0, 2)
    k = (xn @ lp["wk"]).reshape(T, KV, hd).transpose(1, 0, 2)
    v = (xn @ lp["wv"]).reshape(T, KV, hd).transpose(1, 0, 2)
    k = np.repeat(k, H // KV, axis=0)  # query head j uses K/V head j // (H / KV)
    v = np.repeat(v, H // KV, axis=0)
    q, k = _np_rope(q, pos, cfg.rope_theta), _np_rope(k, pos, cfg.rope_theta)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)  # [H, T, T]
    s = np.where(valid[None, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    a = (p @ v).transpose(1, 0, 2).reshape(T, H * hd)
    h = h + a @ lp["wo"]
    xn = _np_rms(h, lp["ff_norm"], cfg.rms_norm_eps)
    g = xn @ lp["w_gate"]
    return h + (g / (1.0 + np.exp(-g)) * (xn @ lp["w_up"])) @ lp["w_down"]


def _np_logits(params, ids, cfg, pos, valid):
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    h = p["wte"][ids]
    for i in range(cfg.n_layers):
        h = _np_layer({k: v[i] for k, v in p["blocks"].items()}, h, cfg, pos, valid)
    return _np_rms(h, p["ln_f"], cfg.rms_norm_eps) @ p["lm_head"]


def _small_cfg(n_kv_heads: int) -> ModelConfig:
    return ModelConfig(d_model=32, n_heads=4, n_kv_heads=n_kv_heads, n_layers=2, mlp_hidden_size=48,
                       vocab_size=64, embedding_size=64, mask_token_id=63, eos_token_id=62, pad_token_id=62,
                       max_sequence_length=128, rope_theta=10000.0)


def _random_params(cfg: ModelConfig, seed: int):
    params = M.init_params(cfg, jax.random.PRNGKey(seed), std=0.25)
    rng = np.random.default_rng(seed)
    # non-trivial norm weights, so a dropped or misplaced norm weight shows
    for k in ("attn_norm", "ff_norm"):
        params["blocks"][k] = jnp.asarray(rng.uniform(0.5, 1.5, params["blocks"][k].shape), jnp.float32)
    params["ln_f"] = jnp.asarray(rng.uniform(0.5, 1.5, params["ln_f"].shape), jnp.float32)
    return params


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_gqa_matches_numpy_reference(n_kv_heads):
    cfg = _small_cfg(n_kv_heads)
    assert cfg.n_kv_heads < cfg.n_heads
    params = _random_params(cfg, seed=n_kv_heads)
    assert params["blocks"]["wk"].shape == (2, 32, n_kv_heads * cfg.head_dim)
    rng = np.random.default_rng(0)
    T, pad = 20, 3
    ids = rng.integers(0, cfg.vocab_size - 2, (T,)).astype(np.int32)
    pos = np.arange(T, dtype=np.int32) - pad  # left padding of 3: positions -3..16, first 3 keys hidden
    valid = pos >= 0

    out = M.forward(params, jnp.asarray(ids[None]), cfg, jnp.asarray(pos[None]), jnp.asarray(pos[None]),
                    jnp.asarray(valid[None]))
    got = np.asarray(M.lm_head(params, out.h, cfg))[0]
    want = _np_logits(params, ids, cfg, pos, valid)
    assert np.std(want) > 0.1
    np.testing.assert_allclose(got[pad:], want[pad:], rtol=1e-4, atol=1e-4)

    # Unpadded, through logits_full (positions 0..T-1, no mask).
    got_full = np.asarray(M.logits_full(params, jnp.asarray(ids[None]), cfg))[0]
    want_full = _np_logits(params, ids, cfg, np.arange(T), np.ones(T, bool))
    np.testing.assert_allclose(got_full, want_full, rtol=1e-4, atol=1e-4)

    # The same model written as plain multi-head attention with repeated K/V projection heads.
    mha = dataclasses.replace(cfg, n_kv_heads=cfg.n_heads)
    g = cfg.n_heads // n_kv_heads

    def rep(w):  # [N, D, KV*hd] -> [N, D, H*hd], K/V head j serving query heads j*g .. j*g+g-1
        n, d, _ = w.shape
        return jnp.repeat(w.reshape(n, d, n_kv_heads, cfg.head_dim), g, axis=2).reshape(n, d, -1)

    p_mha = dict(params, blocks=dict(params["blocks"], wk=rep(params["blocks"]["wk"]),
                                     wv=rep(params["blocks"]["wv"])))
    got_mha = np.asarray(M.logits_full(p_mha, jnp.asarray(ids[None]), mha))[0]
    np.testing.assert_allclose(got_full, got_mha, rtol=0, atol=1e-5)


def test_numpy_reference_matches_golden(tiny_a, tiny_a_cases):
    """Validates the numpy reference itself (MHA path) against the PyTorch golden logits."""
    cfg, params = tiny_a
    case = next(c for c in tiny_a_cases["logits_cases"] if c["name"] == "logits_L16")
    ids = np.asarray(case["input_ids"][0], np.int32)
    want = _np_logits(params, ids, cfg, np.arange(len(ids)), np.ones(len(ids), bool))
    _assert_golden(want.astype(np.float32), np.load(TINY_A_DIR / case["file"])[0], "numpy reference")


# ----------------------------------------------------------------------------------------------- bf16
def test_bfloat16_params(tiny_a, tiny_a_cases):
    cfg, params = tiny_a
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    case = next(c for c in tiny_a_cases["logits_cases"] if c["name"] == "logits_L64")
    ids = jnp.asarray(np.asarray(case["input_ids"], np.int32))
    ref = np.asarray(M.logits_full(params, ids, cfg))
    out = M.logits_full(p16, ids, cfg)
    assert out.dtype == jnp.float32  # the head accumulates in float32
    out = np.asarray(out)
    assert np.all(np.isfinite(out))
    err = np.abs(out - ref)
    assert err.max() <= 0.2 * np.abs(ref).max(), err.max()
    assert err.mean() <= 0.05 * ref.std(), (err.mean(), ref.std())
    assert np.corrcoef(out.ravel(), ref.ravel())[0, 1] > 0.99
    assert (out.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
    # hidden states stay bf16 through the layers
    hs = M.hidden_states(p16, ids, cfg)
    assert hs.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(hs.astype(jnp.float32))))
