"""TPU proxy: the engine's block programs compiled ahead of time for TPU slices on this CPU host.

No TPU is needed. With the ``libtpu`` wheel installed (the test extra installs it), JAX builds a TPU
topology on a CPU host (``jax.experimental.topologies.get_topology_desc``) and runs the whole TPU compiler
for it, Mosaic kernels included, as MaxText's ahead-of-time ``train_compile.py`` does. Each program is
built by the engine itself (:meth:`~polestar_jax.engine.engine.Engine.block_program`, the program a decode
runs per block, with the engine's spec: :meth:`Engine.spec`, :func:`~polestar_jax.engine.engine.running_spec`)
from abstract parameters and states placed on the topology's devices, sharded over a ``(data, model)`` mesh
by the engine's own rules (:mod:`polestar_jax.sharding`)::

    python -m bench.tpu_proxy --json bench/published/tpu/proxy.json      # the whole matrix, 32 layers
    python -m bench.tpu_proxy --targets v5e:2x2 --programs block_polestar_b1
    python -m bench.tpu_proxy --smoke --json out.json                   # a tiny model, one target, seconds

Programs (LLaDA-8B shapes, ``tests/data/llada8b_config.json``, all 32 layers, weights and caches as
``--weights`` says, prompt 256 + gen 256 unless ``--prompt`` / ``--gen`` say otherwise, block 32): ``block_<decoder>_<batch>`` for LLaDA's sampler (``llada``, no cache),
Fast-dLLM's dual cache (``dual``, threshold 0.9) and Polestar (``polestar``, the family's knobs, kernels
``auto``): a fixed batch of 1 and of 32 (``b1``, ``b32``) and a server's running batch of 32 slots
(``running32``: rows at their own blocks, the sampling variant, the step chunk the engine picks).

Targets (:data:`TARGETS`) and their mesh: the layout ``docs/scaling.md`` prescribes, every device of every
host in order, ``model`` = one host's chips (tensor parallel within a host), ``data`` = the hosts (the
batch split across hosts): ``v5e:1x1`` and ``v6e:1x1`` one chip, ``v5e:2x2`` (one host, 4 chips)
``data=1,model=4``, ``v5e:4x4`` (4 hosts of 4 chips, multi-host) ``data=4,model=4``.

On a mesh of several chips each Mosaic kernel runs per shard (XLA cannot partition a Mosaic call itself:
the engine lowers its programs under the mesh and :mod:`kernels.backend` wraps each kernel call in a
``shard_map``, the rows split over ``data``, replicated over ``model``).

``--weights int8`` builds the parameters with int8 matmul weights and a bf16 scale per output channel
(:mod:`polestar_jax.models.quant`; LLaDA-8B's 14.9 GiB of weights become 7.5 GiB); every row says its
``weights``. ``--weights auto`` (the default) picks per target what its user would run
(:func:`auto_storage`): bf16 where one chip's shards of the bf16 parameters take at most half its HBM, else
int8 weights and the int8 K/V cache (LLaDA-8B on one v5e chip). ``--fit-batch``: a batched program left out for want of HBM gets ``largest_fitting_batch``, the
largest batch below its own that compiles and fits (predicted from XLA's bytes, compiled, and the batch above
it shown not to fit; :func:`fit_batch`). ``--kv-cache int8`` stores the K/V cache as int8 with a bf16 scale
per cached row and KV head (:mod:`polestar_jax.models.kv_quant`; ``DecodeConfig.kv_cache``); the
``block_dual_*`` and ``block_polestar_*`` rows take it (LLaDA's sampler keeps no cache: its rows say
``float``); every row says its ``kv_cache``.

``--resume`` keeps the rows of an earlier ``--json FILE`` and compiles only the (program, target) pairs it
lacks (keyed by program, target, weights and K/V cache; a long matrix on a busy machine, in several runs; the meta
file keeps every run's provenance).

Columns (``--json FILE``: a list of rows; the run's date, command, versions and load beside it, FILE's
name with ``.meta.json``): ``program``, ``target``, ``mesh``, ``weights``, ``kv_cache``, ``kernels``,
``compile_seconds``, ``per_device_bytes`` (XLA's memory analysis of the compiled program, per chip: its buffer
assignment's allocations in HBM, where XLA reports them, else arguments + outputs - aliased + temporaries; the
parts as ``argument_bytes``, ``output_bytes``, ``alias_bytes``, ``temp_bytes``, ``host_bytes``, ``allocated_bytes``:
:func:`memory_parts`, :func:`per_device_bytes`), ``hbm_bytes`` (one chip's HBM), ``fits``, ``mosaic_kernels`` (the
``tpu_custom_call``\\ s of the optimized HLO). A program XLA refuses for want of HBM
(``CompileTimeHbmOom``) is a row with ``fits: false``, ``per_device_bytes`` the bytes the compiler said it
needs, ``oom`` the start of XLA's message and ``left_out`` the reason: it was not compiled for that target,
and the table says so. Nothing runs on a TPU.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import sys
import time
from typing import Any, Callable, Iterator, Optional

from bench.gpu_proxy import BLOCK, GEN, PROMPT, _block_name, _output, abstract, meta_path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL_CONFIG = os.path.join(REPO, "tests", "data", "llada8b_config.json")
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU slice: its topology name, one chip's HBM and its hosts."""

    name: str
    hbm_bytes: int


#: The slices compiled for (one chip's HBM: v5e 16 GiB, v6e 32 GiB).
TARGETS = {t.name: t for t in (Target("v5e:1x1", 16 * GIB), Target("v5e:2x2", 16 * GIB),
                               Target("v6e:1x1", 32 * GIB), Target("v5e:4x4", 16 * GIB))}
DECODERS = ("llada", "dual", "polestar")
PROGRAMS = tuple(f"block_{d}_{m}" for d in DECODERS for m in ("b1", "b32", "running32"))
_CALL = 'custom_call_target="tpu_custom_call"'
#: what XLA's HBM OOM at compile time says a program needs ("...required for HLO temporaries (18.55G)
#: exceeds...", or "Used 18.55G of 15.75G hbm")
_OOM = re.compile(r"(?:required for HLO temporaries \(|Used )([\d.]+)([KMGT]?)(?:\)| of)")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ platform


def name_platform() -> None:
    """JAX on the CPU, and libtpu told it is not on a TPU host (so it does not probe for TPU workers) and
    that other processes may load it too (its lock file guards chips this host does not have)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # (no chip to share: other processes may hold libtpu)
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")


def libtpu_problem() -> Optional[str]:
    """One line saying what is missing for a deviceless TPU compile, or None."""
    if importlib.util.find_spec("libtpu") is None:
        return "bench.tpu_proxy needs the libtpu wheel (the TPU compiler): pip install -e '.[test]' (or pip install libtpu)"
    return None


def topology_mesh(target: str):
    """The ``(data, model)`` mesh of a TPU topology built on this host: every device, host by host, ``data``
    = the hosts, ``model`` = one host's chips (docs/scaling.md), through :func:`polestar_jax.sharding.make_mesh`."""
    from jax.experimental import topologies

    from polestar_jax.sharding import make_mesh

    devices = list(topologies.get_topology_desc(topology_name=target, platform="tpu").devices)
    hosts = sorted({d.process_index for d in devices})
    devices.sort(key=lambda d: (d.process_index, d.id))  # (jax.devices() order on the slice)
    per_host = len(devices) // len(hosts)
    mesh = make_mesh({"data": len(hosts), "model": per_host}, devices)
    for row in mesh.devices:  # tensor parallelism stays within a host
        assert len({d.process_index for d in row}) == 1, f"{target}: a model group spans hosts"
    return mesh


def mesh_text(mesh) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.shape.items())


# ------------------------------------------------------------------------------------------ programs


def model_config(layers: Optional[int], smoke: bool):
    """LLaDA-8B's config (``layers`` of its 32; all by default), or a tiny LLaDA-shaped one (``smoke``)."""
    from polestar_jax.config import ModelConfig

    if smoke:
        v = 512
        return ModelConfig(d_model=128, n_heads=4, n_kv_heads=4, n_layers=layers or 2, mlp_hidden_size=352,
                           vocab_size=v, embedding_size=v, mask_token_id=v - 1, eos_token_id=v - 2,
                           pad_token_id=v - 2, max_sequence_length=PROMPT + GEN)
    cfg = ModelConfig.from_json(MODEL_CONFIG)
    return dataclasses.replace(cfg, n_layers=layers or cfg.n_layers,
                               max_sequence_length=max(cfg.max_sequence_length, PROMPT + GEN))


def kv_cache_of(program: str, kv_cache: str) -> str:
    """The K/V cache storage program ``program`` compiles with when ``--kv-cache`` is ``kv_cache``: the
    decoders of :data:`polestar_jax.config.KV_INT8_DECODERS` take it (the dual cache's programs: fastdllm;
    Polestar's), LLaDA's sampler keeps ``float`` (it has no cache)."""
    from polestar_jax.config import KV_INT8_DECODERS

    decoder = _block_name(program)[0]
    return kv_cache if ("fastdllm" if decoder == "dual" else decoder) in KV_INT8_DECODERS else "float"


def decode_config(decoder: str, cfg, kernels: str, kv_cache: str = "float"):
    """The decode config of ``block_<decoder>_*``: LLaDA's sampler, the dual cache (threshold 0.9) or
    Polestar (the family's knobs, ``kernels``), the K/V of the last two stored as ``kv_cache``."""
    from polestar_jax.config import DecodeConfig
    from polestar_jax.models.family import FAMILIES

    if decoder == "llada":
        return DecodeConfig(decoder="llada", cache="none", gen_length=GEN, block_length=BLOCK, threshold=None)
    if decoder == "polestar":
        return DecodeConfig(decoder="polestar", gen_length=GEN, block_length=BLOCK, threshold=0.9,
                            polestar=FAMILIES[cfg.family].polestar_config(kernels=kernels), kv_cache=kv_cache)
    return DecodeConfig(decoder="fastdllm", cache="dual", gen_length=GEN, block_length=BLOCK, threshold=0.9,
                        kv_cache=kv_cache)


def make_engine(cfg, mesh, weights: str = "bfloat16"):
    """An :class:`~polestar_jax.engine.engine.Engine` of abstract bf16 parameters on ``mesh`` (sharded by
    the engine's own rules: whole heads over ``model``); ``weights="int8"``: every matmul weight int8 with a
    bf16 scale per output channel (:func:`polestar_jax.models.quant.quantize_params`)."""
    import jax
    import jax.numpy as jnp

    from polestar_jax.engine.engine import Engine
    from polestar_jax.models import llada as M
    from polestar_jax.models import quant

    mode = "int8" if weights == "int8" else "float"
    params = jax.eval_shape(lambda: quant.quantize_params(
        M.init_params(cfg, jax.random.key(0, impl="rbg"), dtype=jnp.bfloat16), mode))
    return Engine(params, cfg, mesh=mesh)


def compile_block(engine, name: str, kernels: str, batch: Optional[int] = None, kv_cache: str = "float"):
    """Program ``name`` compiled by ``engine`` (:meth:`Engine.block_program`): ``(compiled, seconds)``;
    ``batch``: another batch than the name's (:func:`fit_batch`); ``kv_cache``: the K/V cache's storage."""
    import jax.numpy as jnp  # noqa: F401  (jax is imported by now)

    from polestar_jax.engine.engine import running_spec
    from jax.sharding import NamedSharding, PartitionSpec

    decoder, named, running = _block_name(name)
    batch = batch or named
    dcfg = decode_config(decoder, engine.config, kernels, kv_cache)
    spec = running_spec(engine, dcfg, batch, sampling=True) if running else engine.spec(dcfg)
    state = engine.initial_state([[5] * PROMPT] * batch, dcfg, PROMPT, 0, None, None, abstract=True)
    import jax

    knobs = abstract(jax.eval_shape(lambda: engine.knobs(dcfg, batch if running else None)),
                     NamedSharding(engine.mesh, PartitionSpec()))
    t0 = time.perf_counter()
    prog, _ = engine.block_program(engine.params, state, knobs, spec)
    return prog, time.perf_counter() - t0


def memory_parts(compiled) -> dict:
    """XLA's memory analysis of a compiled program, per chip: ``argument_bytes`` (parameters and the state
    going in), ``output_bytes`` (the state coming out and the statistics), ``alias_bytes`` (outputs written
    into donated arguments' buffers), ``temp_bytes`` (the program's temporaries), ``host_bytes`` (the
    arguments, outputs and temporaries in the chip's host memory, ``pinned_host``: not counted in HBM) and
    ``allocated_bytes`` (its buffer assignment's allocations in HBM, 0 where XLA does not report them)."""
    m = compiled.memory_analysis()
    return {"argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
            "alias_bytes": int(m.alias_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
            "host_bytes": int(getattr(m, "host_argument_size_in_bytes", 0) + getattr(m, "host_output_size_in_bytes", 0)
                              - getattr(m, "host_alias_size_in_bytes", 0) + getattr(m, "host_temp_size_in_bytes", 0)),
            "allocated_bytes": int(getattr(m, "total_allocation_bytes", 0) or 0)}


def per_device_bytes(compiled) -> int:
    """What one chip's HBM holds while the program runs, by XLA's memory analysis: the bytes its buffer
    assignment allocates in HBM (``allocated_bytes``: parameters, outputs, the temporaries' block; the total
    XLA's compile-time HBM check holds against the chip, the one a ``CompileTimeHbmOom`` names); where XLA
    does not report it, arguments + outputs - aliased + temporaries (:func:`memory_parts`), which counted more
    than XLA allocates (LLaDA-8B's Polestar running batch on one v5e chip: 16.10 GiB so, 14.99 GiB allocated)."""
    p = memory_parts(compiled)
    return p["allocated_bytes"] or p["argument_bytes"] + p["output_bytes"] - p["alias_bytes"] + p["temp_bytes"]


def oom_bytes(message: str) -> Optional[int]:
    """The bytes a ``CompileTimeHbmOom`` error says the program needs (None: not that error)."""
    m = _OOM.search(message.replace("\n", " "))
    if not m or "hbm" not in message.lower():
        return None
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": GIB, "T": 1 << 40}[m.group(2)])


def compile_row(engine, name: str, target: Target, mesh, kernels: str = "auto", weights: str = "bfloat16",
                batch: Optional[int] = None, kv_cache: str = "float") -> dict:
    """The row of program ``name`` on ``target`` (see the module docstring); ``batch``: compiled at another
    batch than the name's; ``kv_cache``: ``--kv-cache`` (:func:`kv_cache_of`)."""
    kv_cache = kv_cache_of(name, kv_cache)
    row: dict[str, Any] = {"program": name, "target": target.name, "mesh": mesh_text(mesh),
                           "kernels": kernels if name.startswith("block_polestar") else "none",
                           "weights": weights, "kv_cache": kv_cache, "hbm_bytes": target.hbm_bytes,
                           "prompt": PROMPT, "gen": GEN}
    t0 = time.perf_counter()
    try:
        prog, seconds = compile_block(engine, name, kernels, batch, kv_cache)
    except Exception as e:  # noqa: BLE001 - a program XLA refuses for want of HBM is a row that says so
        need = oom_bytes(str(e))
        if need is None:
            raise
        row.update(compile_seconds=round(time.perf_counter() - t0, 2), per_device_bytes=need, fits=False,
                   mosaic_kernels=None, oom=" ".join(str(e).split())[:400],
                   left_out=f"needs {need / GIB:.2f} GiB of HBM temporaries on one chip "
                   f"(XLA: CompileTimeHbmOom), the chip has {target.hbm_bytes / GIB:g} GiB")
        return row
    used = per_device_bytes(prog)
    row.update(memory_parts(prog))
    row.update(compile_seconds=round(seconds, 2), per_device_bytes=used, fits=used <= target.hbm_bytes,
               mosaic_kernels=prog.as_text().count(_CALL))
    return row


def fit_batch(engine, name: str, target: Target, mesh, row: dict, weights: str, most_probes: int = 5,
              log: Callable[[str], None] = _log, kv_cache: str = "float") -> Optional[dict]:
    """For a batched program left out for want of HBM (``row``), the largest batch below the name's that
    compiles and fits: a batch predicted from the bytes XLA reports (linear in the batch), compiled, then
    the next batch up compiled to show it does not fit. ``{"batch", "per_device_bytes", "compile_seconds",
    "next_needs_bytes"}`` (None: no batch of 1 fits, or the probes ran out)."""
    top = _block_name(name)[1]
    probes: dict[int, dict] = {top: row}

    def probe(b: int) -> dict:
        if b not in probes:
            log(f"  fit search: batch {b} ...")
            probes[b] = compile_row(engine, name, target, mesh, weights=weights, batch=b, kv_cache=kv_cache)
            engine.clear()
        return probes[b]

    probe(max(1, top // 2))
    for _ in range(most_probes):
        good = max((b for b, r in probes.items() if r["fits"]), default=0)
        bad = min(b for b, r in probes.items() if not r["fits"])
        if bad == good + 1:
            return None if not good else {
                "batch": good, "per_device_bytes": probes[good]["per_device_bytes"],
                "compile_seconds": probes[good]["compile_seconds"], "next_needs_bytes": probes[bad]["per_device_bytes"]}
        # the bytes linear in the batch through the two probes nearest the boundary
        b0 = good or min(probes)
        b1 = bad if good or b0 != bad else top
        slope = max(1, (probes[b1]["per_device_bytes"] - probes[b0]["per_device_bytes"]) // max(1, b1 - b0))
        guess = b0 + (target.hbm_bytes - probes[b0]["per_device_bytes"]) // slope
        probe(int(min(bad - 1, max(good + 1, guess))))
    return None


def run(targets: list[str], programs: list[str], layers: Optional[int] = None, smoke: bool = False,
        log: Callable[[str], None] = _log, done: Callable[[list], None] = lambda rows: None,
        rows: Optional[list[dict]] = None, weights: str = "bfloat16", fit: bool = False,
        kv_cache: str = "float") -> list[dict]:
    """Compiles ``programs`` for each of ``targets`` with ``weights`` and ``kv_cache`` (``weights="auto"``:
    per target, :func:`auto_storage`; the (program, target,
    weights, K/V cache) rows ``rows`` already holds are kept, not compiled again); a program that fails
    otherwise is a row with its ``error`` (one line). ``fit``: a batched program left out for want of HBM gets its
    largest fitting batch (:func:`fit_batch`, key ``largest_fitting_batch``). ``done(rows)`` is called after each
    row (the rows so far, in target, program, weights order).
    """
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # (every program compiles here)
    cfg = model_config(layers, smoke)
    # (rows before int8 weights: bf16; before the int8 K/V cache: float)
    rows = [dict(r, weights=r.get("weights", "bfloat16"), kv_cache=r.get("kv_cache", "float"),
                 prompt=r.get("prompt", 256), gen=r.get("gen", 256)) for r in rows or []]
    key = lambda r: (r["program"], r["target"], r["weights"], r["kv_cache"], r["prompt"], r["gen"])
    have = {key(r) for r in rows if "error" not in r}
    rows = [r for r in rows if key(r) in have and "error" not in r]
    order = lambda r: (list(TARGETS).index(r["target"]), PROGRAMS.index(r["program"]), r["weights"], r["kv_cache"])
    asked = (weights, kv_cache)
    for target in targets:
        mesh = topology_mesh(target)
        weights, kv_cache = auto_storage(cfg, mesh, TARGETS[target], asked[1]) if asked[0] == "auto" else asked
        todo = [name for name in programs
                if (name, target, weights, kv_cache_of(name, kv_cache), PROMPT, GEN) not in have]
        if not todo:
            continue
        engine = make_engine(cfg, mesh, weights)
        for name in todo:
            log(f"[tpu_proxy] {name} on {target} ({mesh_text(mesh)}, {cfg.n_layers} layers, {weights} weights, "
                f"{kv_cache_of(name, kv_cache)} K/V cache) ...")
            try:
                row = compile_row(engine, name, TARGETS[target], mesh, weights=weights, kv_cache=kv_cache)
                engine.clear()
                if fit and "left_out" in row and _block_name(name)[1] > 1:
                    row["largest_fitting_batch"] = fit_batch(engine, name, TARGETS[target], mesh, row, weights,
                                                             kv_cache=kv_cache)
                log(f"  {row['per_device_bytes'] / GIB:.2f} GiB per chip of {row['hbm_bytes'] / GIB:g}, "
                    f"{row['mosaic_kernels']} Mosaic kernels, {row['compile_seconds']} s"
                    + (f"; left out: {row['left_out']}" if "left_out" in row else ""))
            except Exception as e:  # noqa: BLE001 - record it and go on with the other programs
                row = {"program": name, "target": target, "mesh": mesh_text(mesh), "weights": weights,
                       "kv_cache": kv_cache_of(name, kv_cache), "prompt": PROMPT, "gen": GEN,
                       "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
                log(f"  error: {row['error']}")
            row["layers"] = cfg.n_layers
            rows.append(row)
            rows.sort(key=order)
            engine.clear()  # (one compiled program held at a time)
            done(rows)
    return rows


def auto_storage(cfg, mesh, target: Target, kv_cache: str = "float") -> tuple[str, str]:
    """``--weights auto``: the (weights, K/V cache) a user of ``target`` would run: bf16 weights and
    ``kv_cache`` where one chip's shards of the bf16 parameters take at most half its HBM, else int8 weights
    and the int8 K/V cache (LLaDA-8B on one v5e chip: 14.9 of 16 GiB in bf16, 7.5 in int8)."""
    import jax
    import numpy as np

    params = make_engine(cfg, mesh, "bfloat16").params
    chip = sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in jax.tree.leaves(params))
    return ("bfloat16", kv_cache) if 2 * chip <= target.hbm_bytes else ("int8", "int8")


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (GiB = 2^30 bytes)."""
    lines = ["| program | target | mesh | weights | kernels | compile s | GiB per chip | HBM GiB | fits | Mosaic kernels |",
             "|---|---|---|---|---|---:|---:|---:|---|---:|"]
    for r in rows:
        kv = ", int8 K/V" if r.get("kv_cache", "float") != "float" else ""
        geo = "" if (r.get("prompt", 256), r.get("gen", 256)) == (256, 256) else f" (prompt {r['prompt']} + gen {r['gen']})"
        head = f"| {r['program']}{geo} | {r['target']} | {r['mesh']} | {r.get('weights', 'bfloat16')}{kv} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:80]} | | | | | |")
        elif "left_out" in r:
            fb = r.get("largest_fitting_batch")
            lines.append(f"{head} {r['kernels']} | {r['compile_seconds']} | {r['per_device_bytes'] / GIB:.2f} "
                         f"| {r['hbm_bytes'] / GIB:g} | **left out** (XLA: HBM OOM)"
                         + (f"; batch {fb['batch']} fits ({fb['per_device_bytes'] / GIB:.2f} GiB)" if fb else "")
                         + " | |")
        else:
            lines.append(f"{head} {r['kernels']} | {r['compile_seconds']} | {r['per_device_bytes'] / GIB:.2f} "
                         f"| {r['hbm_bytes'] / GIB:g} | {'yes' if r['fits'] else 'NO'} | {r['mosaic_kernels']} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main


def provenance(argv: list[str]) -> dict:
    """Date, command, versions (jax, jaxlib, libtpu), commit and machine load of a run."""
    import jax
    import jaxlib

    dirty = _output(["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no"])
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python -m bench.tpu_proxy", *argv]), "jax_version": jax.__version__,
            "jaxlib_version": jaxlib.__version__, "libtpu_version": importlib.metadata.version("libtpu"),
            "commit": _output(["git", "-C", HERE, "rev-parse", "--short", "HEAD"]),
            "uncommitted_changes": None if dirty is None else bool(dirty), "python": platform.python_version(),
            "cpus": os.cpu_count(), "uptime_before": _output(["uptime"])}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.tpu_proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the rows as a JSON list (after each program; the run's "
                    "date, command, versions and load beside it, FILE's name with .meta.json)")
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma list (default: all) from: "
                    + ", ".join(TARGETS))
    ap.add_argument("--programs", default=",".join(PROGRAMS),
                    help="comma list (default: all) from: " + ", ".join(PROGRAMS))
    ap.add_argument("--resume", action="store_true", help="keep the rows of --json FILE and compile only the "
                    "(program, target) pairs it lacks")
    ap.add_argument("--weights", default="auto", choices=["auto", "bfloat16", "int8"],
                    help="the parameters: bfloat16, or int8 matmul weights with a bf16 scale per output channel "
                    "(polestar_jax.models.quant); auto (default): bfloat16 where one chip's shards of them take at "
                    "most half its HBM, else int8 with the int8 K/V cache (one v5e chip); each row says which")
    ap.add_argument("--kv-cache", default="float", choices=["float", "int8"],
                    help="the K/V cache's storage (the dual cache's and Polestar's rows): float (bf16) or int8 "
                    "with a bf16 scale per cached row and KV head (polestar_jax.models.kv_quant); each row says which")
    ap.add_argument("--fit-batch", action="store_true", help="a batched program left out for want of HBM: "
                    "search the largest batch that fits (a few more compiles; key largest_fitting_batch)")
    ap.add_argument("--layers", type=int, default=None, help="LLaDA-8B layers built (default: all 32)")
    ap.add_argument("--prompt", type=int, default=PROMPT, help=f"prompt tokens (default {PROMPT}); each row says")
    ap.add_argument("--gen", type=int, default=GEN, help=f"generated tokens, whole blocks of {BLOCK} (default {GEN}); "
                    "each row says")
    ap.add_argument("--smoke", action="store_true", help="a tiny LLaDA-shaped model (2 layers, d_model 128), "
                    "v5e:1x1 and block_polestar_b1 unless --targets / --programs say otherwise: seconds")
    args = ap.parse_args(argv)
    given = set(a.split("=")[0] for a in argv)
    if args.smoke:
        args.targets = args.targets if "--targets" in given else "v5e:1x1"
        args.programs = args.programs if "--programs" in given else "block_polestar_b1"
    for what, known in (("targets", TARGETS), ("programs", PROGRAMS)):
        items = [p.strip() for p in getattr(args, what).split(",") if p.strip()]
        bad = [p for p in items if p not in known]
        if bad or not items:
            ap.error(f"unknown {what[:-1]}(s) {', '.join(bad) or '(none given)'} (choose from {', '.join(known)})")
        setattr(args, what, items)
    if args.resume and not args.json:
        ap.error("--resume needs --json FILE (the rows to keep)")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    if args.prompt < 1 or args.gen < BLOCK or args.gen % BLOCK:
        ap.error(f"--prompt must be >= 1 and --gen a positive multiple of {BLOCK}, got {args.prompt} and {args.gen}")
    return args


@contextlib.contextmanager
def geometry(prompt: int, gen: int) -> Iterator[None]:
    """Within: every program is built for ``prompt`` prompt tokens and ``gen`` generated ones (``--prompt``,
    ``--gen``); the defaults again after."""
    global PROMPT, GEN
    saved, (PROMPT, GEN) = (PROMPT, GEN), (prompt, gen)
    try:
        yield
    finally:
        PROMPT, GEN = saved


def main(argv: Optional[list[str]] = None) -> int:
    """The command line (module docstring): 0 when every program compiled and every compiled row fits its
    target (rows left out for want of HBM included), 1 when one failed, 2 when no TPU compiler is there."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    name_platform()
    problem = libtpu_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    meta = provenance(argv)
    t0 = time.perf_counter()
    earlier: list[dict] = []
    if args.resume and os.path.exists(args.json):
        with open(args.json) as f:
            earlier = json.load(f)
        if os.path.exists(meta_path(args.json)):
            with open(meta_path(args.json)) as f:
                before = json.load(f)
            meta["earlier_runs"] = before.pop("earlier_runs", []) + [before]

    def write(rows: list[dict]) -> None:
        if not args.json:
            return
        meta.update(seconds=round(time.perf_counter() - t0, 1), uptime_after=_output(["uptime"]))
        for path, obj in ((args.json, rows), (meta_path(args.json), meta)):
            with open(path, "w") as f:
                json.dump(obj, f, indent=1)
                f.write("\n")

    with geometry(args.prompt, args.gen):
        rows = run(args.targets, args.programs, args.layers, args.smoke, done=write, rows=earlier,
                   weights=args.weights, fit=args.fit_batch, kv_cache=args.kv_cache)
    write(rows)
    print(table(rows))
    print(f"\n{meta['date']}, jax {meta['jax_version']}, libtpu {meta['libtpu_version']}, commit {meta['commit']}, "
          f"{round(time.perf_counter() - t0, 1)} s; load before: {meta['uptime_before']}")
    return 1 if any("error" in r or not r.get("fits", True) and "left_out" not in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
