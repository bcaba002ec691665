"""The compacted sparse refresh (:mod:`polestar_jax.decode.polestar.compaction`, the row reads / writes of
:mod:`polestar_jax.decode.polestar.offload`, and the three refresh stages of :func:`polestar_jax.decode.polestar.step.step_forward`):
compaction against numpy, the row store against a plain reference for every storage mode (host and device),
and a refresh step that gives the same result at every number of width buckets while reading only the
rows it selects."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax.decode.polestar import offload as OF
from polestar_jax.decode.polestar import policy as PS
from polestar_jax.decode.polestar import step as PSS
from polestar_jax.decode.polestar import state as PSt
from polestar_jax.decode.polestar import compaction as RF
from polestar_jax.io.checkpoint import load_model
from polestar_jax.config import DecodeConfig, PolestarConfig
from polestar_jax.errors import ConfigError
from polestar_jax.decode.layout import init_decode_state

DATA = os.path.join(os.path.dirname(__file__), "data", "polestar_tiny_p")
GEN, BLOCK = 32, 8
R = 3 * BLOCK
PROMPTS = [[5, 17, 33, 2, 99, 140, 7, 61, 8, 200, 13, 4, 9, 11, 12, 80], [3, 1, 4, 1, 5, 9, 2, 6]]


# ------------------------------------------------------------------------------------------- helpers
def test_widths():
    assert RF.widths(PolestarConfig(refresh_buckets=1), 24) == (0, 24)
    assert RF.widths(PolestarConfig(refresh_buckets=4), 24) == (0, 6, 12, 18, 24)
    assert RF.widths(PolestarConfig(refresh_buckets=4), 10) == (0, 3, 5, 8, 10)  # ceil(i * 10 / 4)
    assert RF.widths(PolestarConfig(refresh_buckets=8), 3) == (0, 1, 2, 3)  # more buckets than rows
    for bad in (0, -1, 1.5):
        with pytest.raises(ConfigError, match="refresh_buckets"):
            PolestarConfig(refresh_buckets=bad)
    # the store's stages: compacted only in host memory; stage 2 complements stage 1 (never beyond R rows)
    pc = PolestarConfig(refresh_buckets=4)
    assert RF.store_widths(pc, 24, host=True) == (0, 6, 12, 18, 24)
    assert RF.store_widths(pc, 24, host=False) == (24,)
    assert RF.complement_widths((0, 6, 12, 18, 24), 24) == (0, 6, 12, 18, 24)
    assert RF.complement_widths((0, 10, 24), 24) == (0, 10, 14, 24)
    assert RF.complement_widths((24,), 24) == (0,)  # stage 1 read every row: nothing left for stage 2
    assert RF.complement_widths((8, 24), 24) == (0, 8, 16)  # at most 24 - 8 rows remain


def test_compact_take_spread():
    rng = np.random.default_rng(0)
    mask = rng.random((5, 13)) < 0.4
    mask[0] = False
    mask[1] = True
    x = rng.standard_normal((5, 13, 3)).astype(np.float32)
    for w in (0, 4, 13):
        idx, val = map(np.asarray, RF.compact(jnp.asarray(mask), w))
        assert idx.shape == val.shape == (5, w)
        for b in range(5):
            true = np.nonzero(mask[b])[0]
            n = min(len(true), w)
            np.testing.assert_array_equal(idx[b, :n], true[:n])  # selected rows first, ascending
            assert val[b, :n].all() and not val[b, n:].any()
            assert len(set(idx[b].tolist())) == w  # a permutation prefix: no row twice
        if w == 13:  # wide enough: take then spread restores the selected rows, zeros elsewhere
            rows = RF.take_rows(jnp.asarray(x), jnp.asarray(idx))
            back = np.asarray(RF.spread_rows(rows, jnp.asarray(idx), jnp.asarray(val), 13))
            np.testing.assert_array_equal(back, np.where(mask[..., None], x, 0))
    # along another axis ([b, H, R, hd] K/V layout)
    y = rng.standard_normal((5, 2, 13, 4)).astype(np.float32)
    idx, val = RF.compact(jnp.asarray(mask), 13)
    t = RF.take_rows(jnp.asarray(y), idx, axis=2)
    np.testing.assert_array_equal(np.asarray(t), np.take_along_axis(y, np.asarray(idx)[:, None, :, None], 2))
    back = np.asarray(RF.spread_rows(t, idx, val, 13, axis=2))
    np.testing.assert_array_equal(back, np.where(mask[:, None, :, None], y, 0))


def test_by_width_picks_the_smallest_width_that_holds_the_batch():
    ws = (0, 6, 12, 18, 24)
    f = jax.jit(lambda c: RF.by_width(c, ws, lambda w: lambda: jnp.int32(w)))
    for counts, want in (([0, 0], 0), ([1, 0], 6), ([6, 2], 6), ([7, 0], 12), ([3, 18], 18), ([19, 1], 24),
                         ([24, 24], 24)):
        assert int(f(jnp.asarray(counts))) == want, counts


# ---------------------------------------------------------------------------------------- row store
@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("mode", ["none", "int8", "bf16"])
def test_fetch_and_write_rows(mode, host, monkeypatch):
    """Rows read from a layer's store are the decoded stored rows (zero where invalid); writing replaces
    exactly the valid rows by their encoding and keeps every other row's bits; a host store stays in host
    memory. ``host=False`` runs the device path (row gather / scatter kernels)."""
    if host and (mode == "none" or not OF.host_memory_available()):
        pytest.skip("no host store for this mode / backend")
    if not host:
        monkeypatch.setattr(OF, "host_memory_available", lambda platform=None: False)
    pc = PolestarConfig(offload_hidden=mode)
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((2, 10, 16)).astype(np.float32) * 3)
    stored, scale = OF.encode(h, pc)
    if host:
        stored, scale = OF.place_store(stored, scale, pc)
    idx = jnp.asarray([[7, 2, 9, 0], [4, 5, 0, 1]], jnp.int32)
    valid = jnp.asarray([[True, True, False, True], [True, False, False, False]])
    new = jnp.asarray(rng.standard_normal((2, 4, 16)).astype(np.float32))

    rows = jax.jit(lambda s, c, i, v: OF.fetch_rows(s, c, i, v, pc, jnp.float32))(stored, scale, idx, valid)
    dec = np.asarray(OF.decode(jnp.asarray(np.asarray(stored)), jnp.asarray(np.asarray(scale)), pc, jnp.float32))
    want = np.where(np.asarray(valid)[..., None], np.take_along_axis(dec, np.asarray(idx)[..., None], 1), 0)
    np.testing.assert_array_equal(np.asarray(rows), want)

    s2, c2 = jax.jit(lambda s, c, i, v, r: OF.write_rows(s, c, i, v, r, pc))(stored, scale, idx, valid, new)
    if host:
        assert s2.sharding.memory_kind == OF.HOST_MEMORY_KIND and c2.sharding.memory_kind == OF.HOST_MEMORY_KIND
    q_new, s_new = map(np.asarray, OF.encode(new, pc))
    want_q, want_s = np.array(np.asarray(stored)), np.array(np.asarray(scale))
    for b in range(2):
        for j in range(4):
            if valid[b, j]:
                want_q[b, idx[b, j]], want_s[b, idx[b, j]] = q_new[b, j], s_new[b, j]
    np.testing.assert_array_equal(np.asarray(s2), want_q)
    np.testing.assert_array_equal(np.asarray(c2), want_s)


# ------------------------------------------------------------------------------- the refresh step
@pytest.fixture(scope="module")
def tiny_p():
    jax.config.update("jax_default_matmul_precision", "highest")
    return load_model(DATA, dtype="float32")


def _started(params, cfg, pc):
    dc = DecodeConfig(decoder="polestar", gen_length=GEN, block_length=BLOCK, polestar=pc)
    st = init_decode_state(cfg, dc, PROMPTS, max(len(p) for p in PROMPTS))
    f = jax.jit(lambda p, s: PS.block_start(p, s, jnp.int32(1), cfg, dc))
    return f(params, st)


@pytest.mark.parametrize("mode,buckets,host", [("none", (1, 4), True), ("int8", (1, 4, 6), True),
                                               ("int8", (1, 4), False)])
def test_refresh_step_same_at_every_bucket_count(tiny_p, monkeypatch, mode, buckets, host):
    """One refresh step at 1 bucket (every stage dense over all R rows) and more buckets (4: the default;
    6: widths of 4 rows), with the exact store (in device memory), the int8 host store (its rows gathered /
    scattered on the host) and the int8 store kept in device memory (a backend without host memory, here
    simulated): the same clusters are selected and the same rows recomputed, and the logits, K/V, centroids
    and the store agree (to float rounding: different matmul shapes); the rows read from a host store per
    layer are the stage widths the selections need, at most the dense read; a store in device memory is read
    whole (one compiled width)."""
    if not host:
        monkeypatch.setattr(OF, "host_memory_available", lambda platform=None: False)
    cfg, params = tiny_p
    start = _started(params, cfg, PolestarConfig(offload_hidden=mode))
    cs = start.x.shape[1] - GEN + BLOCK
    rows = jnp.asarray([True, True])
    outs = {}
    for q in buckets:
        pc = PolestarConfig(offload_hidden=mode, refresh_buckets=q)

        def f(p, s, pc=pc):
            geo = PSt.geometry(s, jnp.int32(cs), BLOCK, pc)
            return PSS.step_forward(p, s, geo, cfg, pc, BLOCK, True, rows, None)

        outs[q] = jax.jit(f)(params, start)
    dense = outs[1]
    sel = np.asarray(dense.selected)  # [N, b, K]
    assert sel.any() and np.asarray(dense.n_rows).sum() > 0
    for q in buckets[1:]:
        o = outs[q]
        for name in ("selected", "own", "n_rows", "sel_suf"):
            np.testing.assert_array_equal(np.asarray(getattr(o, name)), np.asarray(getattr(dense, name)), name)
        close = lambda x, y, name: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * np.abs(y).max(),
                                                              err_msg=name)
        for name in ("logits", "k", "v", "centroids", "s_prev", "drift", "scores"):
            close(np.asarray(getattr(o, name)), np.asarray(getattr(dense, name)), name)
        suf = np.asarray(dense.sel_suf)
        close(np.asarray(o.logits_suf)[suf], np.asarray(dense.logits_suf)[suf], "logits_suf")
        pcq = PolestarConfig(offload_hidden=mode)
        dec = lambda out: np.asarray(OF.decode(jnp.asarray(np.asarray(out.hs)), jnp.asarray(np.asarray(out.hs_scale)),
                                               pcq, jnp.float32))
        a, b = dec(o), dec(dense)
        tol = 2e-5 if mode == "none" else np.abs(b).max(-1, keepdims=True) / 127 + 1e-6  # one int8 step
        assert (np.abs(a - b) <= tol).all()

    # rows read per layer: dense = R for every refreshing layer; compacted, the stage widths the selections
    # need, never more than R (stage 2's widths complement stage 1's), and here fewer in all
    n_rows = np.asarray(dense.n_rows)  # [N, b] rows recomputed per layer (= the next layer's packet)
    moved = {q: np.asarray(outs[q].moved_rows) for q in outs}  # [N, b]
    assert (moved[1] == R).all()
    if not OF.uses_host(PolestarConfig(offload_hidden=mode)):
        assert all((m == R).all() for m in moved.values())
        return
    for q in buckets[1:]:
        ws = RF.widths(PolestarConfig(refresh_buckets=q), R)
        assert (moved[q] <= R).all()
        assert moved[q][0].max() == min(w for w in ws if w >= n_rows[0].max())  # layer 0: no packet
        for layer in range(cfg.n_layers):
            pk = n_rows[layer - 1].max() if layer else 0
            w1 = min(w for w in ws if w >= pk)  # stage 1 reads the packet rows (all rows when w1 == R)
            assert moved[q][layer, 0] - w1 in RF.complement_widths(ws, R)
    if 6 in buckets:  # (on this random model a batch row selects almost every row: 4 buckets fall back to R)
        assert moved[6].sum() < moved[1].sum()


def test_bench_refresh_accounting():
    """bench.bench_refresh's per-layer accounting on hand-made StepOut buffers."""
    from types import SimpleNamespace

    from bench.bench_refresh import accounting

    pc = PolestarConfig(refresh_buckets=4)  # widths 0, 6, 12, 18, 24 for R = 24
    cluster = np.array([[True, False], [False, False], [True, True]])  # [S=3, b=2]: steps 0 and 2 refresh
    moved = np.zeros((3, 2, 2), np.int32)
    refreshed = np.zeros((3, 2, 2), np.int32)
    moved[0] = [[24, 24], [0, 0]]  # (a batch row that does not refresh moves nothing)
    refreshed[0] = [[5, 13], [1, 0]]  # ...but its selection still sizes the batch's stage-3 width
    moved[2] = [[12, 24], [12, 24]]
    refreshed[2] = [[7, 2], [3, 20]]
    st = SimpleNamespace(cluster=cluster, moved_rows=moved, refreshed_rows=refreshed)
    acc = accounting([st], pc, 24)
    assert acc["refresh_steps"] == 2
    assert acc["moved_frac"] == pytest.approx((24 + 24 + 12 + 24) / 2 / 48)
    assert acc["computed_frac"] == pytest.approx((6 + 18 + 12 + 24) / 2 / 48)  # widths of 5, 13; 7, 20
    assert acc["selected_frac"] == pytest.approx((5 + 13 + (7 + 3) / 2 + (2 + 20) / 2) / 2 / 48)
