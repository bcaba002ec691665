"""bench.tpu_proxy: the engine's block programs compiled ahead of time for TPU slices on this CPU host (with
the ``libtpu`` wheel; skipped without it). The smoke run compiles one tiny Polestar block program for a v5e:2x2
slice (4 chips); the meshes follow docs/scaling.md's layout on the topologies libtpu describes."""
from __future__ import annotations

import importlib.util
import json

import jax
import numpy as np
import pytest

from bench import tpu_proxy

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install libtpu): no TPU compiler on this host")

#: XLA's refusal of block_polestar_b1 at LLaDA-8B shapes for one v5e chip (libtpu 0.0.50.1), as it printed it
OOM = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for "
       "HLO temporaries (18.55G) exceeds available HBM (15.75G). HLO module: jit_decode_block.")


def test_kv_cache_goes_to_the_cached_decoders_rows():
    """``--kv-cache int8`` applies to the dual cache's and Polestar's programs (DecodeConfig.kv_cache); LLaDA's
    sampler keeps no cache, its rows say float; the decode configs say so."""
    cfg = tpu_proxy.model_config(None, smoke=True)
    assert [tpu_proxy.kv_cache_of(p, "int8") for p in ("block_dual_b32", "block_llada_b1", "block_polestar_running32")] \
        == ["int8", "float", "int8"]
    assert tpu_proxy.decode_config("dual", cfg, "auto", "int8").kv_cache == "int8"
    assert tpu_proxy.decode_config("polestar", cfg, "auto", "int8").kv_cache == "int8"
    rows = [{"program": "block_dual_b32", "target": "v5e:1x1", "mesh": "data=1,model=1", "weights": "int8",
             "kv_cache": "int8", "kernels": "none", "compile_seconds": 1.0, "per_device_bytes": 1 << 30,
             "hbm_bytes": 16 << 30, "fits": True, "mosaic_kernels": 0}]
    assert "| int8, int8 K/V |" in tpu_proxy.table(rows)


def test_per_device_bytes_are_what_xla_allocates():
    """A row's bytes are the HBM XLA's buffer assignment allocates (the total its compile-time check holds
    against the chip); without that number, arguments + outputs - aliased + temporaries."""
    class Analysis:
        argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes, temp_size_in_bytes = 100, 40, 30, 50
        total_allocation_bytes = 140

    class Compiled:
        def memory_analysis(self):
            return Analysis()

    assert tpu_proxy.per_device_bytes(Compiled()) == 140
    assert tpu_proxy.memory_parts(Compiled())["allocated_bytes"] == 140
    Analysis.total_allocation_bytes = 0
    assert tpu_proxy.per_device_bytes(Compiled()) == 100 + 40 - 30 + 50


def test_oom_bytes_reads_xla_refusal():
    assert tpu_proxy.oom_bytes(OOM) == int(18.55 * (1 << 30))
    assert tpu_proxy.oom_bytes("Ran out of memory in memory space hbm. Used 20.5G of 15.75G hbm.") == int(
        20.5 * (1 << 30))
    assert tpu_proxy.oom_bytes("INVALID_ARGUMENT: Used 3 of 4 slots") is None  # not an HBM refusal


@needs_libtpu
@pytest.mark.parametrize("target,data,model", [("v5e:1x1", 1, 1), ("v5e:2x2", 1, 4), ("v5e:4x4", 4, 4)])
def test_mesh_keeps_model_groups_within_a_host(target, data, model):
    tpu_proxy.name_platform()
    mesh = tpu_proxy.topology_mesh(target)
    assert dict(mesh.shape) == {"data": data, "model": model}
    hosts = [{d.process_index for d in row} for row in mesh.devices]
    assert all(len(h) == 1 for h in hosts) and len(set.union(*hosts)) == data  # one host per data row


@needs_libtpu
def test_rows_say_their_prompt_and_gen_lengths(tmp_path, capsys):
    """``--prompt`` / ``--gen`` build the programs for another geometry (the state's sequence holds both), each
    row says which, and the defaults hold again after the run; a generation that is not whole blocks is a
    one-line error."""
    rows = {}
    for gen in (64, 128):
        out = tmp_path / f"rows{gen}.json"
        assert tpu_proxy.main(["--smoke", "--prompt", "64", "--gen", str(gen), "--json", str(out)]) == 0
        (rows[gen],) = json.loads(out.read_text())
        assert (rows[gen]["prompt"], rows[gen]["gen"], rows[gen]["fits"]) == (64, gen, True)
        assert f"block_polestar_b1 (prompt 64 + gen {gen})" in capsys.readouterr().out
    # (the state going in, its K/V cache and sequence, grows with the generation)
    assert rows[128]["argument_bytes"] > rows[64]["argument_bytes"]
    assert (tpu_proxy.PROMPT, tpu_proxy.GEN) == (256, 256)
    with pytest.raises(SystemExit) as e:
        tpu_proxy.parse_args(["--gen", "40"])
    assert e.value.code == 2 and "multiple of 32" in capsys.readouterr().err


@needs_libtpu
def test_smoke_compiles_a_sharded_polestar_block_with_its_mosaic_kernels(tmp_path):
    """One tiny Polestar block program on a v5e:2x2 slice (model=4): the Mosaic kernels compile per shard
    (kernels.backend: XLA cannot partition a Mosaic call), and the row's bytes are XLA's, per chip."""
    out = tmp_path / "rows.json"
    assert tpu_proxy.main(["--smoke", "--targets", "v5e:2x2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    meta = json.loads((tmp_path / "rows.meta.json").read_text())
    assert meta["jax_version"] == jax.__version__ and meta["libtpu_version"]
    (row,) = rows
    assert {"program", "target", "mesh", "kernels", "compile_seconds", "per_device_bytes", "hbm_bytes", "fits",
            "mosaic_kernels"} <= set(row)
    assert (row["program"], row["target"], row["mesh"], row["kernels"]) == ("block_polestar_b1", "v5e:2x2",
                                                                            "data=1,model=4", "auto")
    # Polestar's kernels (drift, gather, scatter, centroid shift) compiled through Mosaic
    assert row["mosaic_kernels"] >= 4
    # XLA's memory analysis holds at least one chip's shards of the arguments (parameters, decode state),
    # and less than the whole of them: the parameters are split over the 4 chips
    cfg = tpu_proxy.model_config(None, smoke=True)
    engine = tpu_proxy.make_engine(cfg, tpu_proxy.topology_mesh("v5e:2x2"))
    dcfg = tpu_proxy.decode_config("polestar", cfg, "auto")
    state = engine.initial_state([[5] * tpu_proxy.PROMPT], dcfg, tpu_proxy.PROMPT, 0, None, None, abstract=True)
    leaves = jax.tree.leaves((engine.params, state))
    whole = sum(a.size * a.dtype.itemsize for a in leaves)
    shard = sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in leaves)
    assert shard < whole and shard <= row["per_device_bytes"] < 1 << 30
    assert row["hbm_bytes"] == 16 << 30 and row["fits"] is True


@needs_libtpu
def test_auto_storage_is_int8_where_one_chip_cannot_hold_the_bf16_weights():
    """``--weights auto``: LLaDA-8B's bf16 weights (14.9 GiB) on one v5e chip (16 GiB) -> int8 weights and
    K/V cache; on a v5e:2x2 slice (a quarter per chip) and one v6e chip (32 GiB) bf16, the K/V cache asked."""
    tpu_proxy.name_platform()
    cfg = tpu_proxy.model_config(None, smoke=False)
    auto = lambda t, kv="float": tpu_proxy.auto_storage(cfg, tpu_proxy.topology_mesh(t), tpu_proxy.TARGETS[t], kv)
    assert auto("v5e:1x1") == ("int8", "int8")
    assert auto("v5e:2x2") == ("bfloat16", "float") and auto("v6e:1x1", "int8") == ("bfloat16", "int8")
    small = tpu_proxy.model_config(None, smoke=True)
    assert tpu_proxy.auto_storage(small, tpu_proxy.topology_mesh("v5e:1x1"), tpu_proxy.TARGETS["v5e:1x1"]) == \
        ("bfloat16", "float")


@needs_libtpu
def test_int8_weights_shard_as_their_float_weights():
    """``--weights int8``: each int8 weight and its scale split over ``model`` as the float weight does (a
    scale's size-1 input axis replicated), so a chip holds half the weight bytes of bf16."""
    from jax.sharding import PartitionSpec as P

    from polestar_jax.models import quant

    tpu_proxy.name_platform()
    mesh = tpu_proxy.topology_mesh("v5e:2x2")
    cfg = tpu_proxy.model_config(None, smoke=True)
    f, q = (tpu_proxy.make_engine(cfg, mesh, w).params for w in ("bfloat16", "int8"))
    wq, wo = q["blocks"]["wq"], q["blocks"]["wo"]
    assert quant.is_qtensor(wq) and wq.q.dtype == np.int8 and wq.scale.dtype == f["blocks"]["wq"].dtype
    assert wq.q.sharding.spec == wq.scale.sharding.spec == f["blocks"]["wq"].sharding.spec == P(None, None, "model")
    assert wo.q.sharding.spec == f["blocks"]["wo"].sharding.spec == P(None, "model", None)
    assert wo.scale.sharding.spec == P(None, None, None)
    chip = lambda tree: sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))
    assert 0.45 < chip(q) / chip(f) < 0.55


@needs_libtpu
def test_an_engine_compiling_for_a_tpu_keeps_the_store_where_a_tpu_does():
    """``--offload-hidden int8`` in an engine whose parameters live on a TPU topology (compiled ahead of time
    from this CPU host, which has host memory for the store): the store stays in device memory, int8 as asked
    and not packed into host words, with the warning a TPU process gives, as on a TPU
    (``offload.NO_HOST_STORE_PLATFORMS``); so a running batch compiles too. Outside the engine this process's
    own backend still decides (the store goes to its host memory)."""
    from polestar_jax.config import DecodeConfig, PolestarConfig
    from polestar_jax.decode.polestar import offload
    from polestar_jax.engine.engine import running_spec

    tpu_proxy.name_platform()
    cfg = tpu_proxy.model_config(None, smoke=True)
    engine = tpu_proxy.make_engine(cfg, tpu_proxy.topology_mesh("v5e:1x1"))
    assert engine.platform == "tpu"
    dcfg = DecodeConfig(decoder="polestar", gen_length=32, block_length=32, threshold=0.9,
                        polestar=PolestarConfig(offload_hidden="int8"))
    with pytest.warns(RuntimeWarning, match="'tpu'.*stay in device memory"):
        state = engine.initial_state([[5] * 32] * 2, dcfg, 32, 0, None, None, abstract=True)
    hs = state.policy_state.hs
    assert hs.dtype == np.int8 and hs.sharding.memory_kind == "device", (hs.dtype, hs.sharding)
    spec = running_spec(engine, dcfg, 2)  # (refused before: the store was in host memory)
    from jax.sharding import NamedSharding, PartitionSpec

    knobs = tpu_proxy.abstract(jax.eval_shape(lambda: engine.knobs(dcfg, 2)),
                               NamedSharding(engine.mesh, PartitionSpec()))
    prog, _ = engine.block_program(engine.params, state, knobs, spec)
    assert "S(5)" not in prog.as_text()  # nothing in the chip's host memory
    # (outside an engine: the process's backend, this CPU, has host memory for it)
    assert offload.host_memory_available() and not offload.host_memory_available("tpu")
