"""The LLaDA forward pass: golden logits / hidden states, padding invariance, GQA, bfloat16."""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax.models import llada as M
from polestar_jax.config import ModelConfig

TINY_A_DIR = Path(__file__).parent / "data" / "llada_tiny_a"

ATOL = RTOL = 1e-4  # golden tolerance: |a - b| <= 1e-4 + 1e-4 * |ref|

# The golden comparisons use the un-jitted library functions, as ``crosscheck`` does (and, with the session's
# persistent compile cache, they reuse what the crosscheck subprocess compiled). Note: under ``jax.jit`` XLA fuses
# differently and the L512 logits land at ~140% of the golden budget from the PyTorch float32 values, although
# they are closer to a float64 evaluation (~56% of the budget) than the reference itself (~117%).
def _logits(params, ids, cfg) -> np.ndarray:
    return np.asarray(M.logits_full(params, jnp.asarray(ids), cfg))


# model.forward with explicit positions / key mask, jitted (compiled once per shape).
_fwd_logits_impl = jax.jit(
    lambda params, ids, pos, valid, cfg: M.lm_head(params, M.forward(params, ids, cfg, pos, pos, valid).h, cfg),
    static_argnames=("cfg",))


def _fwd_logits(params, ids, cfg, pos, valid) -> np.ndarray:
    """Logits of ``model.forward`` for ids [b, T] at RoPE positions ``pos`` with key mask ``valid``."""
    return np.asarray(_fwd_logits_impl(params, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(valid), cfg=cfg))


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
    out = _logits(params, ids, cfg)
    _assert_golden(out, ref, name)


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
def test_left_padding_with_key_mask_is_invisible(tiny_a, tiny_a_cases):
    """Rows left-padded into one batch, RoPE positions starting at 0 on the first real token and pads hidden
    by the key mask, give the logits of each row alone (the shapes used here are the golden ones, so no extra
    compile). Tolerance 5e-5 + 1e-5*|ref|: float32 sums over a different length are ordered differently
    (measured up to 3.4e-5 on logits of magnitude ~16); leaking pads or unshifted positions give >= 1e-2."""
    cfg, params = tiny_a
    by_name = {c["name"]: np.asarray(c["input_ids"], np.int32) for c in tiny_a_cases["logits_cases"]}
    b2, l16 = by_name["logits_B2_L48"], by_name["logits_L16"]
    rows = [b2[1], l16[0]]  # 48 and 16 tokens
    alone = [_logits(params, b2, cfg)[1], _logits(params, l16, cfg)[0]]
    length = 53
    pads = [length - len(r) for r in rows]  # 5 and 37
    for pad_id in (cfg.pad_token_id, cfg.mask_token_id, 7):  # what the pads hold must not matter
        ids = np.full((2, length), pad_id, np.int32)
        for i, r in enumerate(rows):
            ids[i, pads[i]:] = r
        pos = np.arange(length, dtype=np.int32)[None, :] - np.asarray(pads, np.int32)[:, None]
        valid = pos >= 0
        padded = _fwd_logits(params, ids, cfg, pos, valid)
        for i in range(2):
            np.testing.assert_allclose(padded[i, pads[i]:], alone[i], rtol=1e-5, atol=5e-5,
                                       err_msg=f"row {i} (padding {pads[i]}, pad id {pad_id})")


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
    # An "unsafe_rbg" key: its random-normal kernels compile in a fraction of threefry's time on CPU.
    params = M.init_params(cfg, jax.random.key(seed, impl="unsafe_rbg"), std=0.25)
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

    got = _fwd_logits(params, ids[None], cfg, pos[None], valid[None])[0]
    want = _np_logits(params, ids, cfg, pos, valid)
    assert np.std(want) > 0.1
    np.testing.assert_allclose(got[pad:], want[pad:], rtol=1e-4, atol=1e-4)

    # Unpadded (positions 0..T-1, every key valid).
    got_full = _fwd_logits(params, ids[None], cfg, np.arange(T)[None], np.ones((1, T), bool))[0]
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
    got_mha = _fwd_logits(p_mha, ids[None], mha, np.arange(T)[None], np.ones((1, T), bool))[0]
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
    ref = _logits(params, ids, cfg)
    out = M.logits_full(p16, ids, cfg)
    assert out.dtype == jnp.float32  # the head accumulates in float32
    out = np.asarray(out)
    assert np.all(np.isfinite(out))
    err = np.abs(out - ref)
    assert err.max() <= 0.2 * np.abs(ref).max(), err.max()
    assert err.mean() <= 0.05 * ref.std(), (err.mean(), ref.std())
    assert np.corrcoef(out.ravel(), ref.ravel())[0, 1] > 0.99
    assert (out.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_attention_equals_the_exact_path(dtype):
    """The fused attention a GPU program gets (``jax.nn.dot_product_attention``; here its XLA form, which runs
    on the CPU) computes the exact path's attention: layout, grouped KV heads and the key mask included."""
    from polestar_jax.models import llada

    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (2, 4, 8, 16)).astype(dtype)
    k = jax.random.normal(kk, (2, 2, 24, 16)).astype(dtype)
    v = jax.random.normal(kv, (2, 2, 24, 16)).astype(dtype)
    valid = jnp.arange(24)[None, :] >= jnp.asarray([[0], [5]])  # row 1: 5 left-padded keys
    want = np.asarray(llada.attention_exact(q, k, v, valid), np.float32)
    got = np.asarray(llada.fused_attention(q, k, v, valid, implementation="xla"), np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2 if dtype == jnp.bfloat16 else 1e-5)
    # a running batch's per-row vmap of it: one fused call over every row (the rows folded into its batch),
    # the same rows as the call over the batch, shared keys (not mapped) included
    rows = jax.vmap(lambda q, k, v, m: llada.fused_attention(q[None], k[None], v[None], m[None], "xla")[0],
                    axis_name="rows")(q, k, v, valid)
    np.testing.assert_array_equal(np.asarray(rows, np.float32), got)
    shared = jax.vmap(lambda q, m: llada.fused_attention(q[None], k[:1], v[:1], m[None], "xla")[0])(q, valid)
    np.testing.assert_array_equal(np.asarray(shared[:1], np.float32), got[:1])
    # on a machine without cuDNN every program takes the exact path, bit for bit
    if not llada.cudnn_available():
        np.testing.assert_array_equal(np.asarray(llada.attention(q, k, v, valid), np.float32), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rotated_cache_gives_the_keys_rotated_at_every_step_bit_for_bit(dtype):
    """A cache of rotated keys (rotated once, where each row is written: ``rotated_cache=True``, what the
    Fast-dLLM caches hold) gives the same step as a cache of un-rotated keys rotated at every step: the full
    pass's cache is the un-rotated one rotated at the slots' positions, and a cached step of a block (with a
    masked write) gives the same logits and the same cache (left padding, GQA, jitted): bit for bit in
    bfloat16; in float32 the full pass's cache is bit for bit too, while a step's rows may round in the last
    bit where XLA:CPU contracts the rotation's multiply-add in another fusion (docs/differences.md#d46)."""
    cfg = _small_cfg(2)
    params = jax.tree.map(lambda a: a.astype(dtype), _random_params(cfg, 3))
    b, length, cs, blk = 2, 24, 8, 8
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 62, (b, length)), jnp.int32)
    pad = jnp.asarray([[0], [3]])
    valid = jnp.arange(length)[None, :] >= pad
    pos = jnp.broadcast_to(jnp.arange(length)[None, :] - pad, (b, length)).astype(jnp.int32)
    shape = (cfg.n_layers, b, cfg.n_kv_heads, length, cfg.head_dim)
    empty = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    write = jnp.asarray([[True] * blk, [False, True] * (blk // 2)])  # row 1 keeps half its cached block

    @functools.partial(jax.jit, static_argnames="rotated")
    def run(params, ids, rotated):
        full = M.forward(params, ids, cfg, pos, pos, valid, into=empty, rotated_cache=rotated)
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, cs, blk, axis=1)
        step = M.forward(params, sl(ids), cfg, sl(pos), pos, valid, full.kv, start=cs, write=write,
                         rotated_cache=rotated)
        return full.kv, M.lm_head(params, step.h, cfg), step.kv

    (k0, v0), logits0, (sk0, sv0) = run(params, ids, rotated=False)
    (k1, v1), logits1, (sk1, sv1) = run(params, ids, rotated=True)
    rot = jax.jit(lambda k: M.Rope.at(pos, cfg).rotate(k))
    np.testing.assert_array_equal(np.asarray(k1), np.asarray(jax.vmap(rot)(k0)))
    np.testing.assert_array_equal(np.asarray(v1), np.asarray(v0))
    same = (np.testing.assert_array_equal if dtype == jnp.bfloat16 else
            functools.partial(np.testing.assert_allclose, rtol=2e-6, atol=2e-6))
    same(np.asarray(sk1, np.float32), np.asarray(jax.vmap(rot)(sk0), np.float32))
    same(np.asarray(sv1, np.float32), np.asarray(sv0, np.float32))
    same(np.asarray(logits1), np.asarray(logits0))
    assert not np.array_equal(np.asarray(sk1), np.asarray(sk0))  # (the step's cache does hold rotated keys)


def test_a_cache_shared_by_the_rows_of_a_vmap_reads_and_writes_each_rows_own_entries():
    """The K/V cache a running batch's rows share (``CacheSlot``: not mapped by the per-row vmap, so a layer's
    slice stays contiguous in the rows' loops): inside a layer scan, row writes at each row's own start, row
    scatters, whole-layer writes, reads and a per-row keep give what a cache mapped per row gives, bit for
    bit, and the buffer stays one [N, b, ...] array (no per-row copy)."""
    n_layers, b, kv, length, hd, t = 3, 4, 2, 10, 5, 3
    cache = jax.random.normal(jax.random.PRNGKey(0), (n_layers, b, kv, length, hd))
    u = jax.random.normal(jax.random.PRNGKey(1), (b, 1, kv, t, hd))  # each row's rows [1, KV, T, hd]
    start = jnp.asarray([0, 2, 5, 7], jnp.int32)
    idx = jnp.asarray([[1, 9, 3], [0, 0, 4], [8, 2, 1], [5, 6, 11]], jnp.int32)[:, None]  # (11: dropped)
    valid = jnp.asarray([[1, 1, 0], [1, 0, 1], [1, 1, 1], [0, 1, 1]], bool)[:, None]
    keep = jnp.asarray([True, False, True, False])[:, None]

    def row(c, u, st, ix, va, kp):
        def body(carry, _):
            (k,), i, acc = carry
            slot = M.CacheSlot((k,), i).put_rows((u,), st, axis=2).scatter_rows((2 * u,), ix, va, axis=2)
            got = slot.layer()[0]
            slot = slot.put_layer((3 * got,))
            return (slot.buffers, i + 1, acc + jnp.sum(slot.rows(st, t, axis=2)[0])), jnp.sum(got)

        (bufs, _, acc), ys = jax.lax.scan(body, ((c,), jnp.int32(0), jnp.float32(0)), None, length=n_layers)
        return M.where_own(kp, bufs[0], c), acc, ys

    args = (u, start, idx, valid, keep)
    mapped = jax.vmap(row, in_axes=(1,) + (0,) * 5, out_axes=(1, 0, 0), axis_name="rows")(
        cache.reshape(n_layers, b, 1, kv, length, hd), *args)
    shared = jax.jit(jax.vmap(row, in_axes=(None,) + (0,) * 5, out_axes=(None, 0, 0), axis_name="rows"))(cache, *args)
    assert shared[0].shape == cache.shape
    np.testing.assert_array_equal(np.asarray(shared[0]), np.asarray(mapped[0]).reshape(cache.shape))
    for got, want in zip(shared[1:], mapped[1:]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # outside a vmap (a fixed batch) the same functions are the plain slices and updates
    plain = row(cache, u[:, 0], start[0], idx[:, 0], valid[:, 0], keep[:, 0])
    np.testing.assert_array_equal(np.asarray(plain[0][:, :1]), np.asarray(shared[0][:, :1]))


def test_entry_by_entry_writes_equal_the_row_scatter():
    """A running batch's per-row writes into a shared stacked buffer, a TPU's form (``llada._entry_by_entry``:
    an entry at a time, in place) and the CPU's / GPU's (one row scatter over every entry): the same buffer,
    for block rows at a start per entry and for scattered rows (invalid and out-of-range positions dropped)."""
    from polestar_jax.models import llada

    rng = np.random.default_rng(5)
    n, b, kv, length, hd, c = 3, 4, 2, 10, 8, 3
    a = jnp.asarray(rng.standard_normal((n, b, kv, length, hd)), jnp.float32)
    u = jnp.asarray(rng.standard_normal((b, kv, c, hd)), jnp.float32)
    i = jnp.int32(2)
    start = jnp.asarray([0, 7, 3, 5], jnp.int32)
    idx = jnp.asarray([[0, 4, 9], [2, -1, 1], [9, 10, 3], [5, 6, 7]], jnp.int32)
    valid = jnp.asarray([[True, True, True], [True, True, False], [True, True, True], [False, True, True]])
    for write, rows in ((llada._put_rows, (start,)), (llada._scatter_rows, (idx, valid))):
        want = jax.jit(functools.partial(write, axis=2))(a, u, i, *rows)
        got = jax.jit(functools.partial(llada._entry_by_entry, write, 2))(a, u, i, *rows)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert not np.array_equal(np.asarray(got[2]), np.asarray(a[2])) and np.array_equal(got[:2], a[:2])
