"""GPU proxy: the project's programs compiled for an H200 on the CPU, and their modeled HBM traffic.

No GPU is needed. With the CUDA plugin wheels installed (``pip install -e '.[gpu-proxy]'``: the
``jax-cuda13-plugin`` / ``jax-cuda13-pjrt`` builds of the installed jax), JAX compiles a program for a GPU
described by a target config (``bench/h200_target.txtpb``: an H200, sm_90, 132 SMs, 4.8 TB/s) while
running on the CPU; the compiled program's text is XLA:GPU's optimized HLO (its fusion, dynamic-slice
fusion, async copies and command buffers, without autotuning: the structure is XLA's, the GEMM tiles are
not). :mod:`bench.hlo_traffic` models that HLO's HBM traffic, and this script compares it with the
minimum (:func:`bench.gpu_check.bytes_model`) per program::

    python -m bench.gpu_proxy                                  # every program, 4 layers, a table
    python -m bench.gpu_proxy --layers 2 --json out.json --dump hlo/ --programs dual_step,block_dual_b1
    python -m bench.gpu_proxy --layers 2 --from-dump hlo/ --programs dual_step   # re-model a dump, no compile

Programs, at LLaDA-8B layer shapes (``tests/data/llada8b_config.json``; ``--layers`` of its 32 layers,
bf16, prompt 256 + gen 256 = 512 keys, block 32):

* the step kinds of :mod:`bench.gpu_check` (``lm_head``, ``full``, ``polestar_start``, ``dual_step``,
  ``polestar_step``, ``polestar_refresh_step``; batch 1, Polestar's kernels as the jnp reference), each one
  jitted step as gpu_check times it;
* the engine's block program (``Engine.block_program``, the program a decode runs per block) for the dual
  cache (``fastdllm``, threshold 0.9) and Polestar (the family's knobs, kernels ``reference``): a fixed
  batch of 1 and of 32 (``block_<decoder>_b1``, ``_b32``) and the server's running batch of 32
  (``block_<decoder>_running32``: rows at their own blocks, the sampling variant, compacted step chunks as
  :class:`~polestar_jax.engine.RunningBatch` sets them). A block program's numbers are **per decode step**:
  one iteration of its step loop (the last top-level ``while`` whose body reads the LM head), with the costliest
  branch of each conditional (Polestar: a refresh step) and, in a running batch, every row active (each
  chunk loop at ``batch / chunk`` iterations). Beside it: ``light_*``, the same step with the cheapest
  branch of every conditional in it (Polestar: a step without refresh, against ``polestar_step``'s
  minimum), and ``start_*``, what runs around the loop once per block (the block start and end, against
  the ``full`` / ``polestar_start`` minimum).

Columns (``--json FILE``: a list of rows with these keys and a few more):

* ``modeled_bytes``: the model's HBM bytes of one step; ``min_bytes``: ``bytes_model`` of the same step
  kind, batch and layers (block programs: ``dual_step`` or ``polestar_refresh_step``; ``min_kind``);
* ``kernels``: kernels launched per step divided by the layers (the LM head and sampling included);
* ``weight_copies``: kernels per step that write a weight-sized array without multiplying (a weight slice
  copied before its GEMM reads it, weights pulled into a branch);
* ``host_syncs_per_step``: host-run control flow per step: each iteration of a ``while`` without a known
  trip count and each ``conditional`` (XLA:GPU runs both from the host), and each GEMM on a slice read in
  place (a dynamic-slice fusion) whose offsets are neither constants nor functions of its loop's induction
  variable (its thunk copies them to the host and waits).

Attention (``--attention``): ``exact`` (the default) traces the exact path everywhere, as a GPU without cuDNN
runs it; ``cudnn``: the bf16 passes that need no attention probabilities trace cuDNN's fused attention, as on
a GPU with cuDNN (:func:`trace_cudnn_attention`: this machine has no cuDNN, and the compile needs none).

The proxy names its platform itself (``JAX_PLATFORMS=cpu`` before JAX starts), so a machine with the
plugin and no GPU prints no CUDA/cuDNN errors; without the plugin it exits 2 with one line saying what to
install. ``--dump DIR`` keeps each program's optimized HLO as ``DIR/<program>.hlo.txt``
(``python -m bench.hlo_traffic``-style reading: :class:`bench.hlo_traffic.Model`).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from typing import Any, Callable, Optional

from bench import hlo_traffic

HERE = os.path.dirname(os.path.abspath(__file__))
#: the GPU the programs are compiled for (a GpuTargetConfig text proto)
TARGET_CONFIG = os.path.join(HERE, "h200_target.txtpb")
#: the optional extra that installs the CUDA plugin wheels
EXTRA_HINT = "pip install -e '.[gpu-proxy]'"
PLUGIN_DISTS = ("jax-cuda13-plugin", "jax-cuda13-pjrt")
STEP_PROGRAMS = ("lm_head", "full", "polestar_start", "dual_step", "polestar_step", "polestar_refresh_step")
BLOCK_PROGRAMS = tuple(f"block_{d}_{m}" for d in ("dual", "polestar") for m in ("b1", "b32", "running32"))
PROGRAMS = STEP_PROGRAMS + BLOCK_PROGRAMS
#: the geometry of every program (gpu_check's defaults)
PROMPT, GEN, BLOCK = 256, 256, 32


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ platform


def name_platform() -> None:
    """Runs JAX on the CPU whatever plugins are installed (before JAX is imported, or at least before its
    backends start), so that the CUDA plugin without a GPU stays quiet."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")


def trace_cudnn_attention(on: bool) -> None:
    """Whether the programs trace cuDNN's fused attention (``llada.attention``'s GPU path in bf16 passes that
    need no probabilities), as a GPU with cuDNN compiles them. Tracing it asks JAX for the cuDNN library's
    version; this machine has none, and the deviceless compile needs none (XLA:GPU keeps the fused-attention
    custom call, modeled as one kernel reading Q, K, V and writing the output), so with ``on`` the version
    check is skipped. Off: every program takes the exact path (the score tensors in memory)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    from polestar_jax.models import llada

    if not hasattr(fa, "_proxy_check"):
        fa._proxy_check = fa.check_cudnn_version
    fa.check_cudnn_version = (lambda *a, **k: None) if on else fa._proxy_check
    llada.cudnn_available.cache_clear()


def plugin_problem() -> Optional[str]:
    """One line saying what is missing for a deviceless GPU compile, or None when the CUDA plugin wheels of
    the installed jaxlib are there."""
    try:
        want = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "jaxlib is not installed"
    for dist in PLUGIN_DISTS:
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return f"bench.gpu_proxy needs the CUDA plugin wheels ({dist} {want} missing): {EXTRA_HINT}"
        if have != want:
            return f"bench.gpu_proxy needs {dist}=={want} to match jaxlib (found {have}): {EXTRA_HINT}"
    return None


def gpu_sharding():
    """A single-device sharding on the target GPU (a topology built from :data:`TARGET_CONFIG`)."""
    import jax
    from jax.experimental import topologies

    with open(TARGET_CONFIG) as f:
        target = f.read()
    topo = topologies.get_topology_desc(platform="cuda", target_config=target, topology="1x1x1")
    return jax.sharding.SingleDeviceSharding(topo.devices[0])


def abstract(tree, sharding):
    """``tree``'s arrays (or shape structs) as shape structs placed on ``sharding``."""
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


# ------------------------------------------------------------------------------------------ programs


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every program shares: the model config, gpu_check's check config per batch, the target."""

    layers: int
    sharding: Any
    cfg: Any  # ModelConfig at LLaDA-8B shapes with ``layers`` layers
    params: Any  # abstract bf16 parameters on the target

    def check_config(self, batch: int = 1):
        from bench import gpu_check

        # (Polestar's refresh sizes as the engine picks them for a GPU program: PolestarConfig.for_platform)
        return gpu_check.CheckConfig(layers=self.layers, batch=batch, prompt_length=PROMPT, gen_length=GEN,
                                     block_length=BLOCK, refresh_buckets=1)


def make_setup(layers: int) -> Setup:
    import jax
    import jax.numpy as jnp
    from bench import gpu_check

    # (every program compiles here: no persistent cache or executable store answers for it)
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_compilation_cache_dir", None)
    sh = gpu_sharding()
    cc = gpu_check.CheckConfig(layers=layers, prompt_length=PROMPT, gen_length=GEN, block_length=BLOCK)
    cfg, _ = gpu_check.model_config(cc)
    params = jax.eval_shape(lambda: gpu_check.init_params(cfg, jax.random.key(0, impl="rbg"), dtype=jnp.bfloat16))
    return Setup(layers, sh, cfg, abstract(params, sh))


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A program compiled for the target: its optimized HLO, what the minimum is measured against, and how
    the traffic model reads it (``block``: per iteration of the step loop)."""

    hlo: str
    seconds: float
    min_kind: str
    batch: int
    block: bool = False
    start_kind: Optional[str] = None
    unknown_trips: float = 1.0


def compile_step(kind: str, setup: Setup) -> tuple[str, float]:
    """The optimized HLO and compile seconds of one :mod:`bench.gpu_check` step kind (batch 1; Polestar's
    kernels as the jnp reference)."""
    import warnings

    import jax
    import jax.numpy as jnp
    from bench import gpu_check
    from polestar_jax.engine.engine import compiler_options

    cc = setup.check_config()
    sh = setup.sharding
    if kind == "lm_head":
        state = jax.ShapeDtypeStruct((cc.batch, cc.block_length, setup.cfg.d_model), jnp.bfloat16, sharding=sh)
    else:
        state = abstract(jax.eval_shape(lambda: gpu_check.make_state(setup.cfg, cc, kind.startswith("polestar"))),
                         sh)
    kernels = "reference" if kind in gpu_check.KERNEL_KINDS else "none"
    fn = gpu_check.step_fn(kind, setup.cfg, cc, kernels)
    cs = jax.ShapeDtypeStruct((), jnp.int32, sharding=sh)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers.*")
        # (with the XLA options the engine compiles GPU programs with, as bench.gpu_check times them)
        compiled = jax.jit(fn, donate_argnums=(1,)).lower(setup.params, state, cs).compile(compiler_options("gpu"))
    return compiled.as_text(), time.perf_counter() - t0


def block_config(decoder: str, setup: Setup):
    """The decode config of a block program: the dual cache or Polestar (kernels ``reference``)."""
    from bench import gpu_check
    from polestar_jax.config import DecodeConfig

    if decoder == "polestar":
        pc = gpu_check.polestar_config(setup.cfg, setup.check_config(), "reference")
        return DecodeConfig(decoder="polestar", gen_length=GEN, block_length=BLOCK, threshold=0.9, polestar=pc)
    return DecodeConfig(decoder="fastdllm", cache="dual", gen_length=GEN, block_length=BLOCK, threshold=0.9)


def block_spec(decoder: str, batch: int, running: bool, setup: Setup):
    """(engine, decode config, EngineSpec, step chunk) of a block program: a fixed batch's spec as the engine
    makes it, or a running batch's (per-row blocks, the sampling variant, compacted chunks: as
    ``RunningBatch`` and the server set them)."""
    from polestar_jax.engine.engine import Engine, running_spec

    dcfg = block_config(decoder, setup)
    engine = Engine(setup.params, setup.cfg)
    # (a running batch's spec as RunningBatch builds it, for the engine's platform: the target's)
    spec = running_spec(engine, dcfg, batch, sampling=True) if running else engine.spec(dcfg)
    return engine, dcfg, spec, spec.compact_rows


def compile_block(decoder: str, batch: int, running: bool, setup: Setup) -> tuple[str, float]:
    """The optimized HLO and compile seconds of the engine's block program (``Engine.block_program``)."""
    import jax
    import jax.numpy as jnp
    from bench import gpu_check  # (its init_decode_state: the engine's state builder, wherever it lives)
    from polestar_jax.compat import program_target

    engine, dcfg, spec, _ = block_spec(decoder, batch, running, setup)
    prompts = [[5] * PROMPT] * batch
    with program_target(engine.platform):  # (the state laid out for the GPU, as the engine's own states)
        state = gpu_check.init_decode_state(setup.cfg, dcfg, prompts, PROMPT, abstract=True, dtype=jnp.bfloat16)
    state = abstract(state, setup.sharding)
    knobs = abstract(jax.eval_shape(lambda: engine.knobs(dcfg, batch if running else None)), setup.sharding)
    t0 = time.perf_counter()
    prog, _ = engine.block_program(setup.params, state, knobs, spec)
    return prog.as_text(), time.perf_counter() - t0


def _block_name(name: str) -> tuple[str, int, bool]:
    m = re.fullmatch(r"block_(\w+?)_(b|running)(\d+)", name)
    return m.group(1), int(m.group(3)), m.group(2) == "running"


def describe(name: str, setup: Setup, hlo: str = "", seconds: float = 0.0) -> Compiled:
    """How the traffic model reads program ``name`` (its minimum's step kind, batch, step loop)."""
    if name in STEP_PROGRAMS:
        return Compiled(hlo, seconds, name, 1)
    decoder, batch, running = _block_name(name)
    chunk = block_spec(decoder, batch, running, setup)[3]
    polestar = decoder == "polestar"
    return Compiled(hlo, seconds, "polestar_refresh_step" if polestar else "dual_step", batch, block=True,
                    start_kind="polestar_start" if polestar else "full",
                    unknown_trips=float(-(-batch // chunk) if chunk else 1))


def compile_program(name: str, setup: Setup, from_dump: Optional[str] = None) -> Compiled:
    """Compiles program ``name`` for the target (or, ``from_dump``, reads its HLO from ``DIR/<name>.hlo.txt``)."""
    if from_dump:
        with open(os.path.join(from_dump, f"{name}.hlo.txt")) as f:
            return describe(name, setup, f.read())
    if name in STEP_PROGRAMS:
        return describe(name, setup, *compile_step(name, setup))
    return describe(name, setup, *compile_block(*_block_name(name), setup))


# ------------------------------------------------------------------------------------------ analysis


def weight_shapes(setup: Setup) -> set[tuple[int, ...]]:
    """Shapes a weight-sized copy would have: every parameter, and one layer's slice of a stacked one."""
    import jax

    out = set()
    for leaf in jax.tree.leaves(setup.params):
        out.add(tuple(leaf.shape))
        if len(leaf.shape) > 1 and leaf.shape[0] == setup.layers:
            out.add(tuple(leaf.shape[1:]))
    return out


def step_loop(model: hlo_traffic.Model, head_dims: tuple[int, ...]) -> Optional[hlo_traffic.Loop]:
    """A block program's decode-step loop: the last ``while`` (in program order) outside every other loop
    whose body reads the LM head (``head_dims``). Before it, a running batch's block start may loop over row
    chunks (its body reads the head too); the layer loops of the start read no head."""
    cands = [lp for lp in model.loops() if lp.depth == 0 and model.reads_array(lp.body, head_dims)]
    return cands[-1] if cands else None


def analyze(name: str, comp: Compiled, setup: Setup) -> dict:
    """The row of one compiled program (see the module docstring for the columns)."""
    from bench import gpu_check

    module = hlo_traffic.parse_module(comp.hlo)
    model = hlo_traffic.Model(module, weight_shapes(setup), unknown_trips=comp.unknown_trips)
    cc = setup.check_config(comp.batch)
    minimum = lambda kind: gpu_check.bytes_model(kind, setup.cfg, cc)["total"]
    row: dict[str, Any] = {"program": name, "layers": setup.layers, "batch": comp.batch, "min_kind": comp.min_kind}
    per = model.run()
    if comp.block:
        loop = step_loop(model, tuple(setup.params["lm_head"].shape))
        if loop is None:
            raise RuntimeError(f"{name}: no step loop (a top-level while reading the LM head) in the program")
        per, start = model.per_iteration(loop.name), model.without(loop.name)
        model.cheap_loops.add(loop.name)
        light = model.per_iteration(loop.name)
        light_kind = "polestar_step" if comp.min_kind == "polestar_refresh_step" else comp.min_kind
        row.update(step_loop=loop.name, assumed_inner_trips=comp.unknown_trips, start_bytes=start.bytes,
                   start_min_bytes=minimum(comp.start_kind), start_kernels=start.kernels,
                   start_weight_copies=start.weight_copies, start_host_syncs=start.host_syncs,
                   light_step_bytes=light.bytes, light_min_kind=light_kind, light_min_bytes=minimum(light_kind),
                   light_weight_copies=light.weight_copies, light_host_syncs=light.host_syncs)
    per_layer = 1 if comp.min_kind == "lm_head" else setup.layers
    row.update(modeled_bytes=per.bytes, min_bytes=minimum(comp.min_kind), kernels=per.kernels / per_layer,
               kernels_per_step=per.kernels, weight_copies=per.weight_copies, host_syncs_per_step=per.host_syncs,
               compile_seconds=round(comp.seconds, 2), top_kernels=[[k, v] for k, v in per.by_kernel.most_common(6)])
    row["ratio"] = row["modeled_bytes"] / row["min_bytes"]
    return row


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (GB = 1e9 bytes; block programs: the cheapest step and the block start
    apart, modeled / minimum)."""
    gb = lambda r, a, b: f"{r[a] / 1e9:.2f} / {r[b] / 1e9:.2f}" if a in r else ""
    lines = ["| program | modeled GB/step | minimum GB | ratio | kernels/layer | weight copies | host syncs/step "
             "| cheapest step GB (syncs) | block start GB |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['program']} | error: {r['error'][:80]} | | | | | | | |")
            continue
        light = ""
        if "light_step_bytes" in r:
            light = f"{gb(r, 'light_step_bytes', 'light_min_bytes')} ({r['light_host_syncs']:g})"
        lines.append(f"| {r['program']} | {r['modeled_bytes'] / 1e9:.2f} | {r['min_bytes'] / 1e9:.2f} | "
                     f"{r['ratio']:.2f}x | {r['kernels']:.1f} | {r['weight_copies']:g} | "
                     f"{r['host_syncs_per_step']:g} | {light} | {gb(r, 'start_bytes', 'start_min_bytes')} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main


def _output(cmd: list[str]) -> Optional[str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def provenance(argv: list[str], module: str = "bench.gpu_proxy") -> dict:
    """Date, command (``python -m module argv``), versions, commit (None outside a git checkout) and machine
    load of a run."""
    import jax
    import jaxlib

    dirty = _output(["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no"])
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([f"python -m {module}", *argv]), "jax_version": jax.__version__,
            "jaxlib_version": jaxlib.__version__,
            "plugin_versions": {d: importlib.metadata.version(d) for d in PLUGIN_DISTS},
            "source": os.path.dirname(HERE), "commit": _output(["git", "-C", HERE, "rev-parse", "--short", "HEAD"]),
            "uncommitted_changes": None if dirty is None else bool(dirty),
            "target": os.path.relpath(TARGET_CONFIG, os.path.dirname(HERE)), "python": platform.python_version(),
            "cpus": os.cpu_count(), "uptime_before": _output(["uptime"])}


def run(programs: list[str], setup: Setup, dump: Optional[str], keep_going: bool = True,
        log: Callable[[str], None] = _log, from_dump: Optional[str] = None) -> list[dict]:
    """Compiles and analyzes ``programs`` (``from_dump``: reads their HLO from that folder instead); a program
    that fails is a row with its ``error`` (one line)."""
    layers = setup.layers
    rows = []
    for name in programs:
        log(f"[gpu_proxy] {name} ({layers} layers) ...")
        try:
            comp = compile_program(name, setup, from_dump)
            if dump:
                os.makedirs(dump, exist_ok=True)
                with open(os.path.join(dump, f"{name}.hlo.txt"), "w") as f:
                    f.write(comp.hlo)
            row = analyze(name, comp, setup)
            log(f"  {row['modeled_bytes'] / 1e9:.2f} GB/step vs {row['min_bytes'] / 1e9:.2f} GB minimum, "
                f"compile {comp.seconds:.1f} s")
        except Exception as e:  # noqa: BLE001 - record it and go on with the other programs
            if not keep_going:
                raise
            row = {"program": name, "layers": layers, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            log(f"  error: {row['error']}")
        rows.append(row)
    return rows


def meta_path(json_path: str) -> str:
    """Where the run's provenance goes beside ``--json FILE``: ``x.json`` -> ``x.meta.json``."""
    stem = json_path[:-5] if json_path.endswith(".json") else json_path
    return stem + ".meta.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write the rows as a JSON list (and the run's date, command, "
                    "versions and load beside it, FILE's name with .meta.json)")
    ap.add_argument("--dump", metavar="DIR", help="keep each program's optimized HLO as DIR/<program>.hlo.txt")
    ap.add_argument("--from-dump", metavar="DIR", help="model the HLO of an earlier --dump DIR instead of compiling "
                    "(same --layers)")
    ap.add_argument("--layers", type=int, default=4, choices=(2, 4), help="LLaDA-8B layers built (default 4)")
    ap.add_argument("--attention", default="exact", choices=("cudnn", "exact"),
                    help="bf16 passes without probabilities: cuDNN's fused attention, as a GPU with cuDNN compiles "
                    "them, or the exact path everywhere (the score tensors in memory; default: comparable with earlier runs)")
    ap.add_argument("--programs", default=",".join(PROGRAMS),
                    help="comma list (default: all) from: " + ", ".join(PROGRAMS))
    args = ap.parse_args(argv)
    args.programs = [p.strip() for p in args.programs.split(",") if p.strip()]
    bad = [p for p in args.programs if p not in PROGRAMS]
    if bad or not args.programs:
        ap.error(f"unknown program(s) {', '.join(bad) or '(none given)'} (choose from {', '.join(PROGRAMS)})")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    """The command line (see the module docstring): 0 when every program was modeled, 1 when one failed
    (its row says why), 2 when the deviceless GPU compile cannot start (one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    name_platform()
    problem = plugin_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    meta = provenance(argv)
    meta["attention"] = args.attention
    t0 = time.perf_counter()
    try:
        trace_cudnn_attention(args.attention == "cudnn")
        setup = make_setup(args.layers)
    except Exception as e:  # noqa: BLE001 - a plugin that cannot build the target: one line, no traceback
        print(f"bench.gpu_proxy cannot build the H200 target: {type(e).__name__}: {e}".splitlines()[0],
              file=sys.stderr)
        return 2
    rows = run(args.programs, setup, args.dump, from_dump=args.from_dump)
    meta.update(seconds=round(time.perf_counter() - t0, 1), uptime_after=_output(["uptime"]))
    if args.json:
        for path, obj in ((args.json, rows), (meta_path(args.json), meta)):
            with open(path, "w") as f:
                json.dump(obj, f, indent=1)
                f.write("\n")
    print(table(rows))
    print(f"\n{meta['date']}, jax {meta['jax_version']}, commit {meta['commit']}, {meta['seconds']} s; "
          f"load before: {meta['uptime_before']}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
