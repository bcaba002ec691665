"""The kernels follow the program's target, and compile through Mosaic for real TPU chips from this CPU host.

Two parts:

* without libtpu (any machine): a plain ``jax.export`` for ``tpu`` (no :func:`polestar_jax.compat.export`,
  no ``kernels.backend.staged()``) carries the Mosaic kernels and one for ``cpu`` the references, from the
  same traced program; a multi-platform export carries both; ``jax.vmap`` of a kernel (a running batch's
  per-row program) folds the rows into the kernel's batch axis and still equals the reference.
* with the ``libtpu`` wheel: ``jax.experimental.topologies`` builds a TPU v5e / v6e topology on this CPU
  host and ``jax.jit(f).lower(...).compile()`` runs the whole TPU compiler, Mosaic included (as MaxText's
  ahead-of-time ``train_compile.py`` does). Every kernel compiles at awkward shapes (rows, keys and head
  dims no tile divides; bf16, float32, int8), and the optimized TPU HLO of a Polestar block program (in
  lockstep and per row) holds the ``tpu_custom_call`` of every kernel. Nothing here runs on a TPU.
  Skipped, with the reason, where libtpu is not installed.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax.kernels import kl_drift as KD
from polestar_jax.kernels import refresh as RF

# libtpu probes the host for TPU workers when it loads: these keep it quiet on a machine without a TPU
# (they are read when the first topology is built, after this module is imported)
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# and that another process may hold it (the other pytest-xdist worker compiling for a TPU in
# tests/test_tpu_proxy.py): its lock file guards chips this host does not have; without this the second
# process gets no topology and these tests skip
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

S = jax.ShapeDtypeStruct
_I, _B, _F, _BF, _I8 = jnp.int32, jnp.bool_, jnp.float32, jnp.bfloat16, jnp.int8
_CALL = 'custom_call_target="tpu_custom_call"'

# awkward shapes: 5 query rows, 37 keys, 13 source rows, 7 packet rows, 40 features, head dims 16 / 32 / 128
CASES = {
    "kl_token_bf16_hd128": (functools.partial(KD.kl_drift, mode="token"),
                            [((1, 4, 5, 128), _BF), ((1, 2, 37, 128), _BF), ((1, 37), _B), ((1, 4, 5, 37), _F)]),
    "kl_cluster_f32_hd16": (functools.partial(KD.kl_drift, mode="cluster"),
                            [((2, 4, 5, 16), _F), ((2, 4, 300, 16), _F), ((2, 300), _B), ((2, 4, 5, 300), _F)]),
    "kl_token_bf16_hd32_mqa": (functools.partial(KD.kl_drift, mode="token"),
                               [((2, 4, 16, 32), _BF), ((2, 1, 100, 32), _BF), ((2, 100), _B),
                                ((2, 4, 16, 100), _F)]),
    "gather_f32": (RF.gather_rows, [((2, 13, 40), _F), ((2, 7), _I), ((2, 7), _B)]),
    "gather_bf16": (RF.gather_rows, [((2, 13, 40), _BF), ((2, 7), _I), ((2, 7), _B)]),
    "gather_int8_d4096": (functools.partial(RF.gather_rows, dtype=_BF),
                          [((1, 24, 4096), _I8), ((1, 24), _I), ((1, 24), _B), ((1, 24), _F)]),
    "scatter_f32": (RF.scatter_rows, [((2, 37, 40), _F), ((2, 7, 40), _F), ((2, 7), _I), ((2, 7), _B)]),
    "scatter_scales_f32": (RF.scatter_rows, [((2, 13), _F), ((2, 7), _F), ((2, 7), _I), ((2, 7), _B)]),
    "scatter_kv_f32_hd16": (RF.scatter_kv_rows, [((2, 2, 37, 16), _F), ((2, 2, 7, 16), _F), ((2, 7), _I),
                                                 ((2, 7), _B)]),
    "shift_bf16": (RF.centroid_shift, [((2, 3, 40), _BF), ((2, 13), _I), ((2, 3), _F), ((2, 13), _B),
                                       ((2, 13, 40), _BF), ((2, 13, 40), _BF)]),
    "shift_f32": (RF.centroid_shift, [((2, 3, 40), _F), ((2, 13), _I), ((2, 3), _F), ((2, 13), _B),
                                      ((2, 13, 40), _F), ((2, 13, 40), _F)]),
    # packed rows have no Mosaic scatter (kernels.refresh.mosaic_rows_exclude): XLA's scatter instead
    "scatter_kv_bf16_reference": (RF.scatter_kv_rows, [((1, 2, 37, 16), _BF), ((1, 2, 7, 16), _BF), ((1, 7), _I),
                                                       ((1, 7), _B)]),
}


def _abstract(specs, sharding=None):
    return [S(shape, dt, sharding=sharding) for shape, dt in specs]


def _kernel_names(hlo: str) -> collections.Counter:
    """The Pallas kernels (by name) of an optimized TPU HLO module."""
    return collections.Counter(re.findall(r"%([a-z_]+)\.\d+ = [^\n]*" + re.escape(_CALL), hlo))


# ----------------------------------------------------------------------- the target picks (no libtpu)
def test_plain_export_follows_the_target():
    """One traced program, no staging: lowered for tpu it holds the Mosaic kernel, for cpu the reference;
    a cpu+tpu export holds both behind XLA's platform switch."""
    f, specs = CASES["kl_token_bf16_hd128"]
    jf = jax.jit(f)
    args = _abstract(specs)
    assert "pallas_call" not in str(jax.make_jaxpr(f)(*args))  # the kernel is not traced until lowered
    text = {tuple(p): jax.export.export(jf, platforms=p)(*args).mlir_module() for p in (["tpu"], ["cpu"],
                                                                                      ["cpu", "tpu"])}
    assert "tpu_custom_call" in text[("tpu",)]
    assert "tpu_custom_call" not in text[("cpu",)]
    assert "tpu_custom_call" in text[("cpu", "tpu")] and "platform_index" in text[("cpu", "tpu")]


def test_reference_backend_exports_no_kernel():
    f, specs = CASES["shift_f32"]
    g = functools.partial(f, backend="reference")
    assert "tpu_custom_call" not in jax.export.export(jax.jit(g), platforms=["tpu"])(*_abstract(specs)).mlir_module()


@pytest.mark.parametrize("backend", ["auto", "pallas"])
def test_vmapped_kernel_folds_rows_into_the_batch(backend):
    """vmap over rows (batched and unbatched operands) equals the vmapped reference on this CPU ("pallas":
    the interpreted Mosaic kernel), and the tpu export of the vmapped kernel is one Mosaic call."""
    rng = np.random.default_rng(3)
    n, b, length, c, d = 3, 2, 13, 4, 5
    dst = jnp.asarray(rng.standard_normal((n, b, length, d)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((n, b, c, d)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.permutation(length)[:c] for _ in range(b)]), jnp.int32)  # distinct per row
    valid = jnp.asarray(rng.uniform(size=(b, c)) > 0.3)
    f = jax.vmap(functools.partial(RF.scatter_rows, backend=backend, flavor="mosaic"), in_axes=(0, 0, None, None))
    got = jax.jit(f)(dst, rows, idx, valid)
    want = jax.vmap(RF.scatter_rows_reference, in_axes=(0, 0, None, None))(dst, rows, idx, valid)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    text = jax.export.export(jax.jit(f), platforms=["tpu"])(dst, rows, idx, valid).mlir_module()
    assert text.count("tpu_custom_call") == 1


@pytest.mark.parametrize("int8", [False, True])
def test_packed_gather_block_form_interpreted(monkeypatch, int8):
    """The Mosaic gather of packed rows (bf16; int8 with scales), over two feature blocks (the VMEM budget
    shrunk to force them), equals the reference in the TPU interpreter."""
    monkeypatch.setattr(RF, "_BLOCK_VMEM_BUDGET", 128 * 200)
    assert RF._gather_block_d(13, 7, 256, 2, 2) == 128
    rng = np.random.default_rng(4)
    hs = jnp.asarray(rng.standard_normal((2, 13, 256)), jnp.float32).astype(_BF)
    idx = jnp.asarray(rng.integers(-2, 16, (2, 7)), jnp.int32)  # out of range entries are clipped
    valid = jnp.asarray(rng.uniform(size=(2, 7)) > 0.3)

    def run(hs, idx, valid):
        args = (*RF.quantize_rows(hs), ) if int8 else (hs, None)
        args = (args[0], idx, valid, args[1])
        return (RF.gather_rows(*args, dtype=_BF, interpret=True, flavor="mosaic"),
                RF.gather_rows_reference(*args, dtype=_BF))

    got, want = jax.jit(run)(hs, idx, valid)
    np.testing.assert_array_equal(np.asarray(got.astype(_F)), np.asarray(want.astype(_F)))


# ---------------------------------------------------------------------- compiled for TPUs (libtpu)
@functools.lru_cache(maxsize=None)
def _topology(name: str):
    import jax.experimental.topologies as topologies

    return topologies.get_topology_desc(topology_name=name, platform="tpu")


def _one_chip(name: str) -> jax.sharding.NamedSharding:
    """A single-chip sharding on the TPU topology ``name`` built on this host (skips without libtpu)."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install libtpu): no TPU compiler on this host")
    try:
        topo = _topology(name)
    except Exception as e:  # noqa: BLE001  (libtpu's errors are RuntimeErrors / XlaRuntimeErrors)
        pytest.skip(f"no {name} topology from libtpu: {str(e).splitlines()[0][:120]}")
    mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@pytest.fixture(scope="module", params=["v5e:2x2", "v6e:1x1"])
def tpu(request) -> jax.sharding.NamedSharding:
    return _one_chip(request.param)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_compiles_for_tpu(case, tpu):
    f, specs = CASES[case]
    hlo = jax.jit(f).lower(*_abstract(specs, tpu)).compile().as_text()
    names = _kernel_names(hlo)
    if case.endswith("_reference"):
        assert not names and " scatter(" in hlo
    else:
        assert sum(names.values()) == 1, names


def _block_program(sharding, dtype, per_row: bool, kv_cache: str = "float", offload: str = "none",
                   wide: bool = False):
    """The optimized TPU HLO of a tiny Polestar block program (2 layers, GQA 4 -> 2, prompt 13, block 8) and
    the shape of its stacked K cache (``offload``: the hidden-state store's, in host memory where not none).
    ``wide``: LLaDA-8B's head size (128, 2 heads), prompt 32 + gen 32 (a cache of whole int8 tiles), batch 8."""
    from polestar_jax.config import DecodeConfig, ModelConfig
    from polestar_jax.decode.block import EngineSpec, Knobs, decode_block
    from polestar_jax.models import llada as M
    try:
        from polestar_jax.decode.layout import init_decode_state
    except ImportError:
        from polestar_jax.decode.state import init_decode_state

    cfg = ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=96, vocab_size=64,
                      embedding_size=64, mask_token_id=63, eos_token_id=62, pad_token_id=62, max_sequence_length=128)
    prompt, block, batch = 13, 8, 2
    if wide:
        cfg = dataclasses.replace(cfg, d_model=256, n_heads=2, n_kv_heads=2, mlp_hidden_size=256)
        prompt, block, batch = 32, 32, 8
    from polestar_jax.config import PolestarConfig

    dcfg = DecodeConfig(decoder="polestar", gen_length=32, block_length=block, kv_cache=kv_cache,
                        polestar=PolestarConfig(offload_hidden=offload))
    spec = dataclasses.replace(EngineSpec.from_config(cfg, dcfg), per_row=per_row)
    params = jax.eval_shape(lambda: M.init_params(cfg, jax.random.PRNGKey(0), dtype))
    state = init_decode_state(cfg, dcfg, [[0] * prompt] * batch, prompt, abstract=True, dtype=dtype)
    knobs = jax.eval_shape(lambda: Knobs.from_config(dcfg))
    # (on the chip; the store in its host memory where the state has it there)
    put = lambda tree: jax.tree.map(lambda a: S(a.shape, a.dtype, sharding=sharding.with_memory_kind(
        getattr(getattr(a, "sharding", None), "memory_kind", None) or "device")), tree)
    lowered = jax.jit(decode_block, static_argnames=("spec",)).lower(put(params), put(state), put(knobs), None,
                                                                        spec=spec)
    return lowered.compile().as_text(), jax.tree.leaves(state.k_cache)[0].shape


@pytest.mark.parametrize("dtype,per_row,kv_cache", [(_F, False, "float"), (_BF, True, "float"), (_BF, False, "int8")],
                         ids=["f32-lockstep", "bf16-per-row", "bf16-lockstep-int8-kv"])
def test_polestar_block_compiles_for_tpu_with_its_kernels(dtype, per_row, kv_cache):
    """(One target, v5e, to keep the suite's budget: the kernels alone compile for v5e and v6e above.) No row
    scatter writes into the stacked cache (XLA:TPU copied the whole cache around each one): an int8 cache's
    refresh rows go through the layer's cache (``polestar.step.rows_by_layer``), a running batch's
    per-row writes an entry at a time (``llada._entry_by_entry``). No stacked weight is copied transposed."""
    hlo, shape = _block_program(_one_chip("v5e:2x2"), dtype, per_row, kv_cache)
    names = _kernel_names(hlo)
    want = {"kl_drift_token", "kl_drift_cluster", "centroid_shift", "gather_rows", "scatter_rows"}
    assert want <= set(names), names
    if dtype == _F:  # the float32 K/V caches are written by the row scatter too (bf16 ones by XLA's scatter)
        assert names["scatter_rows"] > 2, names
    # no row scatter into the stacked cache (each layer's, a running batch's rows entry by entry)
    stacked = r"= \w+\[" + ",".join(map(str, shape)) + r"\]\S* scatter\("
    assert not re.search(stacked, hlo), shape
    if kv_cache == "int8":
        assert re.search(r"= s8\[[\d,]+\]\S* scatter\(", hlo)  # (the layer's)
    # no copy of a stacked weight [N, in, out] in a transposed layout (XLA:TPU hoisted one out of a running
    # batch's layer loops: quant.row_major_on_tpu)
    weights = {(2, 64, 64), (2, 64, 32), (2, 64, 96), (2, 96, 64)}  # wq / wo, wk / wv, w_gate / w_up, w_down
    transposed = [m for m in re.findall(r"= \w+\[([\d,]+)\]\{1,2,0[^}]*\} copy\(", hlo)
                  if tuple(map(int, m.split(","))) in weights]
    assert not transposed, transposed


def test_int8_cache_is_written_in_place_for_tpu():
    """With LLaDA-8B's head size and a cache of whole int8 tiles, the TPU program copies no stacked int8
    cache: a block's K/V rows are merged into whole (32, 128) tiles (``llada._put_rows_tiled``), a full pass's
    layer is written row-major (``llada.CacheSlot.put_layer``). Before, XLA:TPU copied the whole stacked
    cache into (8, 128) tiles and back in every layer of every step, and kept the block start's keys
    sequence-minor (LLaDA-8B's Polestar at batch 32 on one v5e chip: 18.34 GiB, now 15.65)."""
    hlo, shape = _block_program(_one_chip("v5e:2x2"), _BF, False, "int8", wide=True)
    # (a copy of the whole stacked cache of its own; fused into a layer's read, a copy's view is no buffer)
    stacked = r"^  %\S+ = s8\[" + ",".join(map(str, shape)) + r"\]\{[^}]*\} copy\("
    assert not re.findall(stacked, hlo, re.M), re.findall(stacked, hlo, re.M)[:3]


@pytest.mark.parametrize("offload", ["int8", "bf16"])
def test_polestar_block_with_its_store_in_host_memory_compiles_for_tpu(offload):
    """Polestar's hidden-state store offloaded (``--offload-hidden``) compiles for a TPU in a fixed batch, the
    store in the chip's host memory (``S(5)``) as 32-bit words (:func:`polestar_jax.decode.polestar.offload.packed`:
    with int8 / bf16 arrays there XLA:TPU stopped at a tile mismatch or at a host computation in a
    conditional). A running batch does not compile so; an engine compiling for a TPU keeps the store in device
    memory, as on a TPU (test_tpu_proxy)."""
    hlo, _ = _block_program(_one_chip("v5e:2x2"), _BF, False, "float", offload)
    words = {"int8": 64 // 4, "bf16": 64 // 2}[offload]  # (d_model 64)
    assert re.search(r"u32\[2,2,24," + str(words) + r"\]\{[^}]*S\(5\)\}", hlo)  # [N, b, R, words] on the host
    assert {"kl_drift_token", "kl_drift_cluster", "centroid_shift"} <= set(_kernel_names(hlo))


def test_full_pass_attention_on_a_tpu_holds_one_heads_scores(monkeypatch):
    """A TPU's attention without probabilities (a full pass) loops over KV heads
    (``llada.attention_by_heads``), so one head group's float32 scores [b, 1, T, L] exist at a time, not every
    head's: XLA's temporaries for 4 rows, 4 heads and 1024 x 1024 scores shrink to under half. (At LLaDA-8B's
    batch 32, prompt 1024 + gen 1024, 4 layers on one v5e chip: 11.56 GiB; without the loop the temporaries
    alone take 24.38 GiB, past its 15.75: bench/README.md, the TPU proxy.)"""
    from polestar_jax.models import llada as M

    chip = _one_chip("v5e:2x2")
    b, h, n, hd = 4, 4, 1024, 128
    args = _abstract([((b, h, n, hd), _BF), ((b, h, n, hd), _BF), ((b, h, n, hd), _BF), ((b, n), _B)], chip)

    def temp_bytes():
        compiled = jax.jit(lambda q, k, v, valid: M.attention(q, k, v, valid)).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    by_heads = temp_bytes()
    monkeypatch.setattr(M, "_HEAD_AT_A_TIME_BYTES", 1 << 62)  # every head at once
    at_once = temp_bytes()
    assert at_once >= b * h * n * n * 4 > 2 * by_heads, (by_heads, at_once)
