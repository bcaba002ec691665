"""Pallas kernels (``polestar_jax.kernels``) in interpret mode against their plain-jnp references, and the
references against the functions of ``polestar_jax`` they replace.

Both kernel flavours run in the interpreter on CPU: "triton" (masked loads / stores, full-extent blocks)
with the generic interpreter, "mosaic" (BlockSpec tiling, scalar prefetch, DMAs) with the TPU interpreter
for the refresh kernels. Shapes are deliberately awkward: lengths that are not multiples of the blocks
(L = 37, 100, 300), T = 1 / 5 / 16, GQA and MQA, batch > 1, masked keys (and a batch row with every key
masked), exact zeros and tiny values in the previous probabilities.

Every interpreted kernel is a separate XLA:CPU compile (the interpreter unrolls the kernel into HLO), so
the cases are few and compiled with ``xla_backend_optimization_level=0``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax.decode.polestar import drift as Dr
from polestar_jax.models import llada as M
from polestar_jax.decode.polestar import state as PSt
from polestar_jax.config import ModelConfig
from polestar_jax.kernels import backend as BK
from polestar_jax.kernels import kl_drift as KD
from polestar_jax.kernels import refresh as RF

import drift_refs  # tests/drift_refs.py

_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _jit(f):
    return jax.jit(f, compiler_options=_FAST_COMPILE)


def _rng(seed):
    return np.random.default_rng(seed)


# ------------------------------------------------------------------------------------------ drift inputs
def _softmax_np(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _drift_inputs(seed, b, h, kv, t, length, hd, dtype):
    """numpy inputs (no eager jax op: each would be a separate XLA compile)."""
    rng = _rng(seed)
    q = jnp.asarray(1.5 * rng.standard_normal((b, h, t, hd)), jnp.float32).astype(dtype)
    k = jnp.asarray(1.5 * rng.standard_normal((b, kv, length, hd)), jnp.float32).astype(dtype)
    key_valid = rng.uniform(size=(b, length)) > 0.25
    key_valid[:, 0] = False  # a masked first key (the running max starts on a -1e30)
    pp = _softmax_np(3.0 * rng.standard_normal((b, h, t, length))).astype(np.float32)
    u = rng.uniform(size=pp.shape)
    pp[u < 0.1] = 0.0  # exact zeros
    pp[(u >= 0.1) & (u < 0.15)] = 1e-30  # below the 1e-12 clamp
    pp[(u >= 0.15) & (u < 0.2)] = 3e-12  # just above it
    return q, k, jnp.asarray(key_valid), jnp.asarray(pp)


# (mode, flavor, b, H, KV, T, L, hd, dtype, block_l, all_masked_row)
_DRIFT_CASES = [
    ("token", "triton", 2, 4, 2, 5, 37, 16, jnp.float32, 16, True),  # GQA, L % block_l != 0, 3 chunks
    ("cluster", "triton", 1, 4, 4, 16, 100, 32, jnp.bfloat16, 32, False),  # bf16, T = 16 (cluster slots)
    ("token", "mosaic", 2, 4, 1, 1, 300, 32, jnp.bfloat16, 128, False),  # MQA, T = 1, 2 chunks + tail 44
    ("cluster", "mosaic", 2, 4, 2, 5, 100, 16, jnp.float32, None, True),  # whole L in one chunk
]


@pytest.mark.parametrize("case", _DRIFT_CASES, ids=lambda c: f"{c[0]}-{c[1]}-T{c[5]}-L{c[6]}-{jnp.dtype(c[8]).name}")
def test_kl_drift_interpret_matches_reference(case):
    mode, flavor, b, h, kv, t, length, hd, dtype, block_l, all_masked = case
    q, k, key_valid, pp = _drift_inputs(length + t, b, h, kv, t, length, hd, dtype)
    if all_masked:
        key_valid = key_valid.at[b - 1].set(False)  # uniform probabilities, no NaN

    def both(q, k, key_valid, pp):
        _, p_ref = KD.kl_drift_reference(q, k, key_valid, pp, mode=mode)
        # head 0 of row 0 compares with itself: KL ~ 0 (rounding may make it negative: clamped to 0)
        pp = pp.at[0, 0].set(p_ref[0, 0])
        got = KD.kl_drift(q, k, key_valid, pp, mode=mode, interpret=True, flavor=flavor, block_l=block_l)
        return got, KD.kl_drift_reference(q, k, key_valid, pp, mode=mode)

    (d, p), (d_ref, p_ref) = _jit(both)(q, k, key_valid, pp)
    assert d.shape == (b, t) and p.shape == (b, h, t, length)
    assert d.dtype == p.dtype == jnp.float32
    d, p, d_ref, p_ref = map(np.asarray, (d, p, d_ref, p_ref))
    assert np.isfinite(d).all() and np.isfinite(p).all()
    np.testing.assert_allclose(p, p_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(d, d_ref, rtol=1e-5, atol=2e-6)
    assert (d >= 0).all()
    # invalid keys have probability exactly 0 (unless the whole row is masked: then uniform)
    kvn = np.asarray(key_valid)
    hidden = (~kvn & kvn.any(axis=1, keepdims=True))[:, None, None, :]
    assert np.where(hidden, p, 0.0).max() == 0.0
    if all_masked:
        np.testing.assert_allclose(p[b - 1], 1.0 / length, rtol=1e-6)


def _small_cfg(n_kv_heads=2):
    return ModelConfig(d_model=32, n_heads=4, n_kv_heads=n_kv_heads, n_layers=1, mlp_hidden_size=48,
                       vocab_size=64, embedding_size=64, mask_token_id=63, eos_token_id=62, pad_token_id=62,
                       max_sequence_length=128, rope_theta=10000.0)


def test_kl_drift_reference_equals_polestar_drift():
    """The reference is bit-identical to model.attention + drift.token_drift and to
    drift.proxy_attention + drift.cluster_drift (the code it replaces), each compiled on its own."""
    cfg = _small_cfg()
    b, t, length, n_cl = 2, 5, 37, 6
    rng = _rng(1)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    lp = {"attn_norm": jnp.asarray(rng.uniform(0.5, 1.5, (cfg.d_model,)), jnp.float32),
          "wq": 0.3 * f32(cfg.d_model, cfg.d_model)}
    q, k, key_valid, pp = _drift_inputs(7, b, cfg.n_heads, cfg.n_kv_heads, t, length, cfg.head_dim, jnp.float32)
    v = f32(*k.shape)
    cent = f32(b, n_cl, cfg.d_model)
    s_prev = jnp.asarray(_softmax_np(2.0 * rng.standard_normal((b, cfg.n_heads, n_cl, length))), jnp.float32)
    s_prev = s_prev.at[:, :, :, :4].set(0.0)

    @jax.jit
    def polestar_side(q, k, v, key_valid, pp, cent, s_prev):
        _, p_attn = M.attention(q, k, v, key_valid, return_probs=True)
        s = Dr.proxy_attention(lp, cent, k, cfg, key_valid)
        return p_attn, drift_refs.token_drift(p_attn, pp), s, drift_refs.cluster_drift(s, s_prev)

    @jax.jit
    def kernel_side(q, k, key_valid, pp, cent, s_prev):
        xn = M.rms_norm(cent, lp["attn_norm"], cfg.rms_norm_eps)  # the proxy queries (no RoPE)
        qc = (xn @ lp["wq"]).reshape(b, n_cl, cfg.n_heads, cfg.head_dim).transpose(0, 2, 1, 3)
        d_tok, p_tok = KD.kl_drift_reference(q, k, key_valid, pp, mode="token")
        d_cl, p_cl = KD.kl_drift_reference(qc, k, key_valid, s_prev, mode="cluster")
        return p_tok, d_tok, p_cl, d_cl

    want = polestar_side(q, k, v, key_valid, pp, cent, s_prev)
    got = kernel_side(q, k, key_valid, pp, cent, s_prev)
    for name, g, w in zip(("p_token", "token_drift", "proxy_attention", "cluster_drift"), got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_kl_drift_auto_on_cpu_is_reference_and_validates():
    q, k, key_valid, pp = _drift_inputs(3, 1, 2, 1, 3, 20, 8, jnp.float32)

    @jax.jit
    def both(q, k, key_valid, pp):
        return KD.kl_drift(q, k, key_valid, pp, mode="token"), KD.kl_drift_reference(q, k, key_valid, pp, mode="token")

    if jax.default_backend() == "cpu":  # auto = the reference on cpu: the same computation
        (d, p), (d_ref, p_ref) = both(q, k, key_valid, pp)
        np.testing.assert_array_equal(np.asarray(d), np.asarray(d_ref))
        np.testing.assert_array_equal(np.asarray(p), np.asarray(p_ref))
    shapes = jax.eval_shape(lambda: KD.kl_drift(q, k, None, pp, mode="cluster", backend="reference"))
    assert shapes[0].shape == (1, 3) and shapes[1].shape == pp.shape
    with pytest.raises(ValueError, match="mode"):
        KD.kl_drift(q, k, key_valid, pp, mode="tokens")
    with pytest.raises(ValueError, match="multiple of KV"):
        KD.kl_drift(q[:, :1], jnp.concatenate([k, k], 1), key_valid, pp[:, :1], mode="token")
    with pytest.raises(ValueError, match="backend"):
        KD.kl_drift(q, k, key_valid, pp, mode="token", backend="cuda")


def test_block_sizes():
    assert KD.block_sizes("triton", 1, 37, 128) == (16, 64)
    assert KD.block_sizes("triton", 32, 4096, 64) == (32, 128)
    assert KD.block_sizes("triton", 5, 100, 16, block_l=100) == (16, 128)
    assert KD.block_sizes("mosaic", 32, 4096, 128) == (32, 512)
    assert KD.block_sizes("mosaic", 5, 37, 128) == (5, 37)
    assert KD.block_sizes("mosaic", 5, 1000, 128, block_l=200) == (5, 256)
    assert KD.block_sizes("mosaic", 512, 1000, 128) == (256, 512)
    with pytest.raises(ValueError):
        KD.block_sizes("mosaic", 20, 100, 16, block_t=12)


def test_resolve_backend():
    assert BK.resolve_backend("auto", "cpu") == "reference"
    assert BK.resolve_backend("auto", "gpu") == "pallas"
    assert BK.resolve_backend("auto", "cuda") == "pallas"
    assert BK.resolve_backend("auto", "tpu") == "pallas"
    assert BK.resolve_backend("pallas", "cpu") == "interpret"
    assert BK.resolve_backend("pallas", "tpu") == "pallas"
    assert BK.resolve_backend("interpret", "tpu") == "interpret"
    assert BK.resolve_backend("reference", "cuda") == "reference"
    assert BK.resolve_backend("auto") == ("pallas" if jax.default_backend() in ("gpu", "tpu") else "reference")
    assert BK.resolve_backend("auto", "rocm", kernel="kl_drift") == "reference"  # no verified lowering
    assert BK.resolve_backend("pallas", "rocm", kernel="kl_drift") == "interpret"
    with pytest.raises(ValueError):
        BK.resolve_backend("triton")


# --------------------------------------------------------------------------------------------- refresh
def _packet(rng, b, n_src, c, distinct):
    if distinct:
        idx = np.stack([rng.permutation(n_src)[:c] for _ in range(b)])
    else:
        idx = rng.integers(0, n_src, (b, c))
    valid = rng.uniform(size=(b, c)) > 0.35
    return idx.astype(np.int32), valid


@pytest.mark.parametrize("flavor,dtype,int8", [("triton", jnp.bfloat16, True), ("mosaic", jnp.float32, False),
                                               ("mosaic", jnp.bfloat16, True)])
def test_gather_rows_interpret(flavor, dtype, int8):
    b, r, d, c = 2, 11, 40, 7
    rng = _rng(5)
    hs = jnp.asarray(rng.standard_normal((b, r, d)), jnp.float32).astype(dtype)
    idx, valid = _packet(rng, b, r, c, distinct=False)
    idx[0, 0], idx[1, 1] = r + 3, -2  # out of range: clipped (like polestar._rows_at)
    idx, valid = jnp.asarray(idx), jnp.asarray(valid)
    kw = dict(dtype=dtype) if int8 else {}

    def run(hs, idx, valid):
        args = (*RF.quantize_rows(hs),) if int8 else (hs, None)
        args = (args[0], idx, valid, args[1])
        return (RF.gather_rows(*args, interpret=True, flavor=flavor, **kw), RF.gather_rows_reference(*args, **kw),
                PSt.rows_at(hs, idx))

    got, want, plain = _jit(run)(hs, idx, valid)
    assert got.dtype == want.dtype == jnp.dtype(dtype) and got.shape == (b, c, d)
    got, want, plain = (np.asarray(a.astype(jnp.float32)) for a in (got, want, plain))
    np.testing.assert_array_equal(got, want)
    vn = np.asarray(valid)[..., None]
    assert np.abs(np.where(vn, 0, got)).max() == 0.0
    if not int8:  # the float path is polestar._rows_at, masked
        np.testing.assert_array_equal(got, np.where(vn, plain, 0))


def test_quantize_rows_roundtrip():
    h = _rng(8).standard_normal((3, 9, 50)) * np.arange(1, 10)[None, :, None]
    h[0, 0] = 0.0  # an all-zero row
    q, s, back, back16 = _jit(lambda h: (*RF.quantize_rows(h), RF.dequantize_rows(*RF.quantize_rows(h)),
                                          RF.dequantize_rows(*RF.quantize_rows(h), jnp.bfloat16)))(
        jnp.asarray(h, jnp.float32))
    assert q.dtype == jnp.int8 and s.shape == (3, 9) and s.dtype == jnp.float32
    q, s, back = np.asarray(q).astype(np.int32), np.asarray(s), np.asarray(back)
    assert np.abs(q).max() == 127
    assert (np.abs(back - h) <= s[..., None] / 2 + 1e-5).all()
    assert s[0, 0] == 0.0 and (back[0, 0] == 0).all()
    np.testing.assert_array_equal(np.asarray(back16.astype(jnp.float32)),
                                  np.asarray(jnp.asarray(back).astype(jnp.bfloat16).astype(jnp.float32)))


@pytest.mark.parametrize("flavor", ["triton", "mosaic"])
def test_scatter_rows_interpret(flavor):
    b, length, c = 2, 13, 7
    rng = _rng(9)
    dst = jnp.asarray(rng.standard_normal((b, length, 3, 5)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((b, c, 3, 5)), jnp.float32)
    idx, valid = _packet(rng, b, length, c, distinct=True)
    idx[1, 0], valid[1, 0] = length + 4, True  # out of range: dropped even though valid
    idx, valid = jnp.asarray(idx), jnp.asarray(valid)
    got, want = _jit(lambda *a: (RF.scatter_rows(*a, interpret=True, flavor=flavor),
                                 RF.scatter_rows_reference(*a)))(dst, rows, idx, valid)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # rows not addressed by a valid entry are untouched
    touched = np.zeros((b, length), bool)
    for i in range(b):
        for j in range(c):
            if bool(valid[i, j]) and 0 <= int(idx[i, j]) < length:
                touched[i, int(idx[i, j])] = True
    np.testing.assert_array_equal(np.asarray(got)[~touched], np.asarray(dst)[~touched])


@pytest.mark.parametrize("flavor", ["triton", "mosaic"])
def test_scatter_kv_rows_interpret_matches_polestar(flavor):
    """K/V layout [b, KV, L, hd]: equals a direct indexed write with invalid entries pointed past the end."""
    b, kv, length, hd, c = 2, 2, 19, 8, 6
    rng = _rng(11)
    cache = jnp.asarray(rng.standard_normal((b, kv, length, hd)), jnp.float32).astype(jnp.bfloat16)
    rows = jnp.asarray(rng.standard_normal((b, kv, c, hd)), jnp.float32).astype(jnp.bfloat16)
    idx, valid = map(jnp.asarray, _packet(rng, b, length, c, distinct=True))
    got, ref, want = _jit(lambda cache, rows, idx, valid: (
        RF.scatter_kv_rows(cache, rows, idx, valid, interpret=True, flavor=flavor),
        RF.scatter_kv_rows_reference(cache, rows, idx, valid),
        cache.at[jnp.arange(b)[:, None], :, jnp.where(valid, idx, length)].set(
            rows.transpose(0, 2, 1, 3), mode="drop")))(cache, rows, idx, valid)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _shift_inputs(seed, b, k, r, d, dtype):
    rng = _rng(seed)
    cent = jnp.asarray(rng.standard_normal((b, k, d)), jnp.float32).astype(dtype)
    labels = rng.integers(-1, k - 1, (b, r)).astype(np.int32)  # slot k-1 empty (count 0); -1 unlabelled
    counts = (labels[..., None] == np.arange(k)).sum(1).astype(np.float32)
    rows = rng.uniform(size=(b, r)) > 0.4
    h_old = rng.standard_normal((b, r, d))
    h_new = h_old + 0.3 * rng.standard_normal((b, r, d))
    cast = lambda a: jnp.asarray(a, jnp.float32).astype(dtype)
    return cent, jnp.asarray(labels), jnp.asarray(counts), jnp.asarray(rows), cast(h_old), cast(h_new)


def _np_shift(cent, labels, counts, rows, h_old, h_new):
    c = np.asarray(cent.astype(jnp.float32), np.float64)
    lab, cnt, rw = np.asarray(labels), np.asarray(counts, np.float64), np.asarray(rows)
    ho, hn = (np.asarray(a.astype(jnp.float32), np.float64) for a in (h_old, h_new))
    out = c.copy()
    for b in range(c.shape[0]):
        for k in range(c.shape[1]):
            sel = rw[b] & (lab[b] == k)
            if cnt[b, k] > 0:
                out[b, k] += (hn[b, sel].sum(0) - ho[b, sel].sum(0)) / (cnt[b, k] + 1e-6)
    return out


def test_centroid_shift_triton_block_fits_shared_memory():
    """The Triton shift kernel's feature block keeps its dot operands under the shared-memory budget for
    every dtype and window size (float32 rows, R = 96, D = 512 asked for 264 KiB at a block of 256 and did not
    compile on an H200), and a smaller block gives the same values (interpret mode, several feature blocks)."""
    for itemsize in (2, 4):
        for k in (4, 8, 16, 32):
            for r in (24, 96, 128, 256):
                for d in (40, 128, 512, 4096):
                    bk, br = RF._pow2(k, 16), RF._pow2(r, 16)
                    bd = RF._shift_block_d(d, bk, br, itemsize)
                    assert 16 <= bd <= 256 and (2 * br * bd + bk * br) * itemsize <= RF._SHIFT_SMEM_BUDGET
    assert RF._shift_block_d(512, 16, 128, 4) == 128 and RF._shift_block_d(4096, 16, 128, 2) == 256
    args = _shift_inputs(16, 1, 8, 96, 512, jnp.float32)
    got, want = _jit(lambda a: (RF.centroid_shift(*a, interpret=True, flavor="triton"),
                                RF.centroid_shift_reference(*a)))(args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("flavor", ["triton", "mosaic"])
def test_centroid_shift_interpret(flavor):
    b, k, r, d = 2, 5, 24, 40
    cases = [_shift_inputs(14, b, k, r, d, jnp.float32), _shift_inputs(15, b, k, r, d, jnp.bfloat16)]

    def run(cases):  # both dtypes in one compile
        return [(RF.centroid_shift(*a, interpret=True, flavor=flavor), RF.centroid_shift_reference(*a))
                for a in cases]

    for args, (got, want) in zip(cases, _jit(run)(cases)):
        assert got.dtype == want.dtype == args[0].dtype and got.shape == want.shape
        g, w = (np.asarray(a.astype(jnp.float32)) for a in (got, want))
        # the reference against the spec formula in float64 (E: c_k += (sum_new - sum_old) / (count_k + 1e-6))
        np.testing.assert_allclose(w, _np_shift(*args), rtol=1e-5 if want.dtype == jnp.float32 else 2 ** -6,
                                   atol=1e-5 if want.dtype == jnp.float32 else 2 ** -6)
        if want.dtype == jnp.float32:
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
        else:  # member sums of bf16 rows may round differently (accumulation order): one bf16 ulp
            np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=2 ** -7)
        empty = np.asarray(args[2] == 0)  # clusters without members keep their centroid exactly
        np.testing.assert_array_equal(g[empty], np.asarray(args[0].astype(jnp.float32))[empty])


def test_references_share_the_wrapper_signatures():
    import inspect

    pairs = [(KD.kl_drift, KD.kl_drift_reference), (RF.gather_rows, RF.gather_rows_reference),
             (RF.scatter_rows, RF.scatter_rows_reference), (RF.scatter_kv_rows, RF.scatter_kv_rows_reference),
             (RF.centroid_shift, RF.centroid_shift_reference)]
    for f, ref in pairs:
        assert list(inspect.signature(f).parameters) == list(inspect.signature(ref).parameters), f.__name__
