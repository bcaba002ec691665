"""Polestar's hidden-state store offload (``PolestarConfig.offload_hidden``, :mod:`polestar_jax.decode.polestar.offload`):
int8 / bf16 encodings, placement in ``pinned_host`` memory, the refresh patching only selected rows, the
lowered GPU module's placement annotations, and the fallback where a backend has no host memory."""
from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax import compat
from polestar_jax.kernels import refresh as kernels_refresh
from polestar_jax.decode.polestar import offload as OF
from polestar_jax.decode.polestar import policy as PS
from polestar_jax.decode.polestar import step as PSS
from polestar_jax.decode.polestar import state as PSt
from polestar_jax.io.checkpoint import load_model
from polestar_jax.config import DecodeConfig, PolestarConfig
from engines import generate  # tests/engines.py
from polestar_jax.decode.layout import init_decode_state

DATA = os.path.join(os.path.dirname(__file__), "data", "polestar_tiny_p")
MODES = ("none", "int8", "bf16")
GEN, BLOCK = 32, 8


@pytest.fixture(scope="module")
def tiny_p():
    jax.config.update("jax_default_matmul_precision", "highest")
    return load_model(DATA, dtype="float32")


def test_encode_decode_roundtrip():
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((2, 5, 33)).astype(np.float32) * rng.uniform(0.1, 30, (2, 5, 1)))
    h = h.at[1, 2].set(0.0)  # an all-zero row
    for mode in MODES:
        pc = PolestarConfig(offload_hidden=mode)
        q, s = OF.encode(h, pc)
        assert q.dtype == OF.store_dtype(pc, jnp.float32) and s.shape == h.shape[:-1]
        back = np.asarray(OF.decode(q, s, pc, jnp.float32))
        err = np.abs(back - np.asarray(h))
        absmax = np.abs(np.asarray(h)).max(-1, keepdims=True)
        if mode == "none":
            assert err.max() == 0
        elif mode == "int8":
            assert q.dtype == jnp.int8
            assert (err <= absmax / 254 * (1 + 1e-5) + 1e-12).all()  # half a quantisation step
            assert (back[1, 2] == 0).all()
        else:
            assert (err <= np.abs(np.asarray(h)) * 2.0 ** -8 + 1e-30).all()


def test_a_host_store_holds_its_rows_as_whole_words():
    """In host memory the encoded rows are 32-bit words (4 int8 or 2 bf16 values each, the same bits), where
    the row width fills whole words: XLA:TPU did not compile 8- and 16-bit host arrays (OF.packed)."""
    rng = np.random.default_rng(1)
    for d, words in ((32, True), (33, False)):
        h = jnp.asarray(rng.standard_normal((2, 5, d)).astype(np.float32))
        for mode in ("int8", "bf16"):
            pc = PolestarConfig(offload_hidden=mode)
            q, s = OF.encode(h, pc)
            plain, _ = (kernels_refresh.quantize_rows(h) if mode == "int8" else (h.astype(jnp.bfloat16), None))
            shape, dt = OF.store_shape(pc, h.shape, jnp.float32)
            assert (q.shape, q.dtype) == (shape, dt)
            if words and OF.host_memory_available():
                assert dt == jnp.uint32 and shape[-1] == d * plain.dtype.itemsize // 4
                unpacked = jax.lax.bitcast_convert_type(q, plain.dtype).reshape(plain.shape)
                np.testing.assert_array_equal(np.asarray(unpacked), np.asarray(plain))  # the same bits
            else:
                assert dt == plain.dtype
            np.testing.assert_array_equal(np.asarray(OF.decode(q, s, pc, jnp.float32)),
                                          np.asarray(OF.decode(plain, s, pc, jnp.float32)))


def _start_state(cfg, pc, prompts, dtype=jnp.float32, abstract=False):
    dc = DecodeConfig(decoder="polestar", gen_length=GEN, block_length=BLOCK, polestar=pc)
    return init_decode_state(cfg, dc, prompts, max(len(p) for p in prompts), dtype=dtype, abstract=abstract)


PROMPTS = [[5, 17, 33, 2, 99, 140, 7, 61, 8, 200, 13, 4, 9, 11, 12, 80], [3, 1, 4, 1, 5, 9, 2, 6]]


def _after_start(params, cfg, pc):
    st = _start_state(cfg, pc, PROMPTS)
    dc = DecodeConfig(decoder="polestar", gen_length=GEN, block_length=BLOCK, polestar=pc)
    f = jax.jit(lambda p, s: PS.block_start(p, s, jnp.int32(1), cfg, dc))
    return f(params, st)


@pytest.fixture(scope="module")
def started(tiny_p):
    cfg, params = tiny_p
    return {m: _after_start(params, cfg, PolestarConfig(offload_hidden=m)) for m in ("none", "int8")}


def test_block_start_stores_encoded_rows_in_host_memory(tiny_p, started):
    cfg, _ = tiny_p
    exact = np.asarray(started["none"].policy_state.hs)
    assert np.abs(exact).max() > 0
    # (int8 here; bf16's encoding: test_encode_decode_roundtrip)
    pol = started["int8"].policy_state
    pc = PolestarConfig(offload_hidden="int8")
    assert (pol.hs.shape, pol.hs.dtype) == OF.store_shape(pc, exact.shape, jnp.float32)
    if OF.host_memory_available():
        assert pol.hs.sharding.memory_kind == OF.HOST_MEMORY_KIND
        assert pol.hs_scale.sharding.memory_kind == OF.HOST_MEMORY_KIND
    back = np.asarray(OF.decode(jnp.asarray(np.asarray(pol.hs)), jnp.asarray(np.asarray(pol.hs_scale)),
                                pc, jnp.float32))
    tol = np.abs(exact).max(-1, keepdims=True) / 254  # half a quantisation step
    assert (np.abs(back - exact) <= tol * (1 + 1e-5) + 1e-12).all()
    # everything else of the block start is the exact pass (the store is only written there)
    for name in ("labels", "n_clusters", "counts"):
        np.testing.assert_array_equal(getattr(started["int8"].policy_state, name), getattr(started["none"].policy_state, name))
    assert started["none"].policy_state.hs.sharding.memory_kind != OF.HOST_MEMORY_KIND or not OF.host_memory_available()


def test_refresh_patches_only_selected_rows(tiny_p, started):
    """A refresh step rewrites only the rows of the clusters the previous layer selected (for rows that
    refresh at all); every other stored row keeps its bits, and the int8 store tracks the exact one within
    quantisation noise."""
    cfg, params = tiny_p
    outs = {}
    rows = jnp.asarray([True, False])  # batch row 1 does not refresh in this step
    for mode in ("none", "int8"):
        pc = PolestarConfig(offload_hidden=mode)
        st = started[mode]
        cs = st.x.shape[1] - GEN + BLOCK

        def f(p, s):
            geo = PSt.geometry(s, jnp.int32(cs), BLOCK, pc)
            return PSS.step_forward(p, s, geo, cfg, pc, BLOCK, True, rows, None)

        out = outs[mode] = jax.jit(f)(params, st)
        old_q, new_q = np.asarray(st.policy_state.hs), np.asarray(out.hs)
        old_s, new_s = np.asarray(st.policy_state.hs_scale), np.asarray(out.hs_scale)
        changed = (old_q != new_q).any(-1) | (old_s != new_s)  # [N, b, R]
        # expected patch of layer l: rows clustered at l whose layer-(l-1) cluster was selected
        labels = np.asarray(st.policy_state.labels)  # [N, b, R]
        sel = np.asarray(out.selected)  # [N, b, K]
        picked = np.take_along_axis(sel, np.clip(labels, 0, sel.shape[-1] - 1), axis=2) & (labels >= 0)
        expected = np.zeros_like(changed)
        expected[1:] = picked[:-1] & (labels[1:] >= 0)
        assert not sel[:, 1].any() and not changed[:, 1].any(), "a row that does not refresh keeps its store"
        assert not changed[0].any(), "layer 0's inputs (embeddings) are never patched"
        assert changed.any(), "no row refreshed"
        assert not (changed & ~expected).any(), "only rows of selected clusters are patched"
        assert changed.sum() >= 0.9 * expected.sum()  # (a patched row may round to its old bits)
        if mode == "int8" and OF.host_memory_available():
            assert out.hs.sharding.memory_kind == OF.HOST_MEMORY_KIND
    np.testing.assert_array_equal(np.asarray(outs["none"].selected), np.asarray(outs["int8"].selected))
    # The int8 step is the exact step applied to what the int8 store holds, up to the rounding of what it
    # writes: run the exact store's step on a store holding the int8 store's decoded rows; every row of the
    # int8 result then lies within half a quantisation step of that reference (a patched row's error does
    # not compound through the layers it was recomputed through).
    int8 = PolestarConfig(offload_hidden="int8")
    st8 = started["int8"].policy_state
    held = OF.decode(jnp.asarray(np.asarray(st8.hs)), jnp.asarray(np.asarray(st8.hs_scale)), int8, jnp.float32)
    st_ref = started["none"].replace(policy_state=started["none"].policy_state.replace(hs=held))
    pc0 = PolestarConfig(offload_hidden="none")
    cs = st_ref.x.shape[1] - GEN + BLOCK
    ref = jax.jit(lambda p, s: PSS.step_forward(p, s, PSt.geometry(s, jnp.int32(cs), BLOCK, pc0), cfg, pc0,
                                                BLOCK, True, rows, None))(params, st_ref)
    np.testing.assert_array_equal(np.asarray(ref.selected), np.asarray(outs["int8"].selected))
    want = np.asarray(ref.hs)
    back = np.asarray(OF.decode(jnp.asarray(np.asarray(outs["int8"].hs)),
                                jnp.asarray(np.asarray(outs["int8"].hs_scale)), int8, jnp.float32))
    half_step = np.abs(want).max(-1, keepdims=True) / 254
    assert (np.abs(back - want) <= half_step * (1 + 1e-4) + 1e-6).all()
    # and the int8 store stays near the exact one (a loose sanity bound; the tight check is the one above)
    exact = np.asarray(outs["none"].hs)
    assert (np.abs(back - exact) <= 0.25 * np.abs(exact).max(-1, keepdims=True) + 1e-6).all()


def test_generate_with_offload(tiny_p):
    """Whole generations with the int8 store: every token committed, the refresh ran, and a batch of rows
    that finish blocks at different steps gives each row what it gets alone."""
    cfg, params = tiny_p
    a, b = [5, 17, 33, 2, 99, 140, 7, 61, 8, 200, 13, 4], [3, 1, 4, 1, 5, 9, 2, 6]
    dc = {"int8": DecodeConfig(decoder="polestar", cache="dual", gen_length=GEN, block_length=BLOCK,
                               threshold=0.9, polestar=PolestarConfig(offload_hidden="int8"))}
    batch = generate(params, cfg, [a, b], dc["int8"], seed=5, rows=[3, 4], prompt_slot=16)
    assert (batch.tokens != cfg.mask_token_id).all()
    assert int(batch.polestar["refresh_steps"].sum()) > 0  # the refresh (and its store reads) ran
    for r, (p, seed) in enumerate(((a, 3), (b, 4))):
        alone = generate(params, cfg, [p], dc["int8"], seed=5, rows=[seed], prompt_slot=16)
        np.testing.assert_array_equal(batch.tokens[r], alone.tokens[0])
        np.testing.assert_array_equal(batch.nfe[r], alone.nfe[0])
        for k in ("refresh_steps", "early", "suffix"):
            np.testing.assert_array_equal(batch.polestar[k][r], alone.polestar[k][0])
    # (how far int8 moves the output from the exact store is a benchmark question: bench.run's
    # polestar-int8 row on the trained model; this random model's near-tied cluster scores amplify it)


def test_offload_placement_annotations_in_gpu_export(tiny_p):
    """The whole block step exported for cuda (and tpu): with int8 offload the store arguments/results carry
    ``memory_kind = "pinned_host"``, the module moves rows with ``annotate_device_placement`` and gathers /
    scatters them with host computations; without offload none of these appears."""
    from polestar_jax.decode.block import EngineSpec, Knobs, decode_block as run_block

    cfg, params = tiny_p
    texts = {}
    for mode, platform in (("none", "cuda"), ("int8", "cuda"), ("int8", "tpu")):
        pc = PolestarConfig(offload_hidden=mode)
        dc = DecodeConfig(decoder="polestar", gen_length=GEN, block_length=BLOCK, polestar=pc)
        state = _start_state(cfg, pc, PROMPTS, abstract=True)  # the store in host memory where offloaded
        abstract_params = jax.eval_shape(lambda: params)
        knobs = jax.eval_shape(lambda: Knobs.from_config(dc))
        checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]  # the Pallas kernels
        exp = compat.export(jax.jit(run_block, static_argnames=("spec",)), platforms=[platform],
                            disabled_checks=checks)(
            abstract_params, state, knobs, None,
            spec=EngineSpec.from_config(cfg, dc))
        texts[mode if platform == "cuda" else platform] = exp.mlir_module()
    t = texts["int8"]
    assert 'mhlo.memory_kind = "pinned_host"' in t
    assert '_xla_buffer_placement = "pinned_host"' in t and '_xla_buffer_placement = "device"' in t
    n, r, d = cfg.n_layers, 3 * BLOCK, cfg.d_model
    # the int8 store [N, b, R, D] is an argument/result, in 32-bit words (OF.packed)
    assert all(f"tensor<{n}x2x{r}x{d // 4}xui32>" in texts[k] for k in ("int8", "tpu"))
    assert "pinned_host" not in texts["none"] and "annotate_device_placement" not in texts["none"]
    # the store's row gathers / scatters run on the host, so only compacted rows cross: the narrowest
    # compiled width (R / 4 rows of int8) is one of the moved shapes
    assert '_xla_compute_type = "host"' in t and "_xla_compute_type" not in texts["none"]
    assert f"tensor<2x{r // 4}x{d}xi8>" in t
    # the same step lowers for TPU, with the same host placement and host computations
    assert 'mhlo.memory_kind = "pinned_host"' in texts["tpu"] and '_xla_compute_type = "host"' in texts["tpu"]


def test_host_store_only_where_the_refresh_step_compiles(monkeypatch):
    """A device offloads the store when it has pinned_host memory and is not a GPU or a TPU (where XLA did
    not compile the block program with the store in host memory: an H200 with jax 0.11.2; LLaDA-8B's 32
    layers for v5e with libtpu 0.0.50.1); the fallback's warning says which of the two it is."""
    from types import SimpleNamespace

    dev = lambda platform, *kinds: SimpleNamespace(
        platform=platform, addressable_memories=lambda: [SimpleNamespace(kind=k) for k in kinds])
    assert OF.host_store_supported(dev("cpu", "device", OF.HOST_MEMORY_KIND))
    assert not OF.host_store_supported(dev("tpu", "device", OF.HOST_MEMORY_KIND))
    assert not OF.host_store_supported(dev("gpu", "device", OF.HOST_MEMORY_KIND))
    assert not OF.host_store_supported(dev("cpu", "device"))
    assert OF.host_store_supported(jax.devices()[0]) == OF.host_memory_available()
    monkeypatch.setattr(OF, "host_memory_available", lambda platform=None: False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    hs, sc = jnp.zeros((2, 1, 4, 8), jnp.int8), jnp.zeros((2, 1, 4), jnp.float32)
    with pytest.warns(RuntimeWarning, match="block program does not compile on 'gpu'"):
        OF.place_store(hs, sc, PolestarConfig(offload_hidden="int8"))


def test_an_abstract_state_on_a_mesh_keeps_its_store_sharding_in_host_memory(tiny_p):
    """An ahead-of-time compile's abstract state on a mesh (a TPU topology's, the engine's) has the store where
    the engine puts it: the mesh's sharding in ``pinned_host`` memory, not one device of the default backend."""
    from jax.sharding import Mesh, NamedSharding

    cfg, _ = tiny_p
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    dc = DecodeConfig(decoder="polestar", gen_length=GEN, block_length=BLOCK,
                      polestar=PolestarConfig(offload_hidden="int8"))
    state = init_decode_state(cfg, dc, [[5] * 8] * 2, 8, abstract=True, mesh=mesh)
    pol = state.policy_state
    for a in (pol.hs, pol.hs_scale):
        assert isinstance(a.sharding, NamedSharding) and a.sharding.mesh == mesh, a.sharding
        assert a.sharding.memory_kind == OF.HOST_MEMORY_KIND
    assert state.k_cache.sharding.memory_kind in (None, "device")


def test_an_engine_for_a_tpu_keeps_the_store_in_device_memory(monkeypatch, tiny_p):
    """Where the store lives follows the devices an engine's parameters live on, not this process's backend:
    for a TPU (``offload.NO_HOST_STORE_PLATFORMS``: XLA:TPU did not compile LLaDA-8B's programs with it in
    host memory, nor any per-row program) it stays in device memory, in the offload dtype, with a warning, and
    a running batch's spec is built, its steps compacted as with no offload (rows of a store in device memory
    may be gathered); on this CPU it goes to host memory and steps are not compacted. (An engine on a real TPU
    topology, compiled ahead of time: tests/test_tpu_proxy.py.)"""
    from polestar_jax.engine.engine import Engine, running_spec

    cfg, params = tiny_p
    eng = Engine(params, cfg)
    dc = lambda mode: DecodeConfig(decoder="polestar", gen_length=GEN, block_length=BLOCK,
                                   polestar=PolestarConfig(offload_hidden=mode))
    here = eng.initial_state([[1, 2, 3]] * 2, dc("int8"), 8, 0, None, None)
    assert (here.policy_state.hs.sharding.memory_kind == OF.HOST_MEMORY_KIND) == OF.host_memory_available()
    if OF.host_memory_available():
        assert running_spec(eng, dc("int8"), 72).compact_rows == 0 < running_spec(eng, dc("none"), 72).compact_rows
    monkeypatch.setattr(Engine, "platform", property(lambda self: "tpu"))
    for mode in ("int8", "bf16"):
        assert running_spec(eng, dc(mode), 4).per_row
        assert running_spec(eng, dc(mode), 72).compact_rows == running_spec(eng, dc("none"), 72).compact_rows == 9
        with pytest.warns(RuntimeWarning, match="'tpu'.*stay in device memory"):
            state = eng.initial_state([[1, 2, 3]] * 2, dc(mode), 8, 0, None, None)
        hs = state.policy_state.hs
        assert hs.sharding.memory_kind != OF.HOST_MEMORY_KIND and hs.dtype == OF.store_dtype(dc(mode).polestar,
                                                                                              jnp.float32)


def test_backend_without_host_memory_falls_back(monkeypatch, tiny_p):
    cfg, _ = tiny_p
    monkeypatch.setattr(OF, "host_memory_available", lambda platform=None: False)
    pc = PolestarConfig(offload_hidden="int8")
    assert not OF.uses_host(pc)
    hs = jnp.zeros((2, 1, 4, 8), jnp.int8)
    sc = jnp.zeros((2, 1, 4), jnp.float32)
    with pytest.warns(RuntimeWarning, match="pinned_host"):
        hs2, sc2 = OF.place_store(hs, sc, pc)
    assert hs2.sharding.memory_kind != OF.HOST_MEMORY_KIND and hs2.dtype == jnp.int8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OF.place_store(hs, sc, PolestarConfig())  # no offload: no warning
    # the traced step carries no placement when the backend cannot hold it
    text = jax.jit(lambda x: OF.to_host(x, pc)).lower(hs).as_text()
    assert "annotate_device_placement" not in text
