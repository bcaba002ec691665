"""Which loops XLA:GPU would run on the device: the programs compiled for an H200 (on the CPU, as
:mod:`bench.gpu_proxy` does) with ``while`` and ``conditional`` allowed in command buffers (CUDA graphs
whose conditional nodes loop and branch on the device, no host synchronisation), read from XLA's own thunk
sequence (``thunk_sequence_after_thunk_passes.txt`` of ``--xla_dump_to``)::

    python -m bench.command_buffers [--json FILE] [--programs toy_stacked,toy_per_layer,block_dual_b1]

A control-flow thunk (``kWhile``, ``kConditional``) inside a ``kCommandBuffer`` runs on the device; one
outside runs from the host (a host synchronisation per iteration or branch, unless its trip count is
known). Programs: two toy decoders, a ``while`` over steps around a layer loop over 4 stacked weights
(``toy_stacked``: each layer's GEMM reads its slice in place, a dynamic-slice fusion) or over 4 separate
weight arrays (``toy_per_layer``), and the engine's block programs of :mod:`bench.gpu_proxy` (2 layers at
LLaDA-8B shapes). The question it answers: whether the engine's GPU programs could drop their host
synchronisations by compiling with device-side control flow (see bench/README.md, the H200 proxy).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
from typing import Optional

from bench import gpu_proxy

#: XLA:GPU's default command types (jax 0.12) with ``while`` and ``conditional`` added
COMMAND_TYPES = "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,DYNAMIC_SLICE_FUSION,COLLECTIVES_KERNEL,WHILE,CONDITIONAL"
TOYS = ("toy_stacked", "toy_per_layer")
PROGRAMS = TOYS + ("block_dual_b1", "block_polestar_b1")
_THUNK = re.compile(r"^(\s*)\d+: (k\w+)")
CONTROL = ("kWhile", "kConditional")


def control_flow(thunks: str) -> dict[str, int]:
    """Counts of the control-flow thunks of a thunk sequence's text: ``on_host`` (not nested in a
    ``kCommandBuffer``) and ``on_device`` (nested in one), by indentation."""
    stack: list[tuple[int, str]] = []
    out = {"on_host": 0, "on_device": 0}
    for line in thunks.splitlines():
        m = _THUNK.match(line)
        if not m:
            continue
        indent, kind = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if kind in CONTROL:
            out["on_device" if any(k == "kCommandBuffer" for _, k in stack) else "on_host"] += 1
        stack.append((indent, kind))
    return out


def _thunk_text(dump: str) -> str:
    """The thunk sequence XLA runs (after its thunk passes; the pass leaves no file when it changed nothing)."""
    after = glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt"))
    files = after or glob.glob(os.path.join(dump, "*thunk_sequence.txt"))
    if not files:
        raise RuntimeError(f"XLA wrote no thunk sequence into {dump}")
    with open(files[0]) as f:
        return f.read()


def _toy(per_layer: bool):
    """A step loop (until a value passes a bound) around a 4-layer GEMM loop; the weights stacked [4, d, d]
    under ``lax.scan`` or 4 separate [d, d] arrays."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def layers(h, w):
        if per_layer:
            for wl in w:
                h = jnp.tanh(h @ wl)
            return h
        return lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), h, w)[0]

    def decode(w, x):
        return lax.while_loop(lambda c: jnp.any(c[0] < 10.0), lambda c: (layers(c[0], w) + 1.0, c[1] + 1), (x, 0))

    sh = gpu_proxy.gpu_sharding()
    d = 1024
    w = ([jax.ShapeDtypeStruct((d, d), jnp.bfloat16, sharding=sh) for _ in range(4)] if per_layer
         else jax.ShapeDtypeStruct((4, d, d), jnp.bfloat16, sharding=sh))
    return jax.jit(decode).lower(w, jax.ShapeDtypeStruct((8, d), jnp.bfloat16, sharding=sh))


def measure(name: str, setup=None) -> dict:
    """One program's control-flow thunks with device-side control flow allowed."""
    from polestar_jax.engine import engine

    base = dict(engine.compiler_options("gpu") or {})
    with tempfile.TemporaryDirectory() as dump:
        opts = dict(base, xla_gpu_enable_command_buffer=COMMAND_TYPES, xla_dump_to=dump)
        if name in TOYS:
            _toy(name == "toy_per_layer").compile(opts)
        else:
            saved = engine.COMPILER_OPTIONS["gpu"]
            engine.COMPILER_OPTIONS["gpu"] = opts  # (the engine's own block program, with these options)
            try:
                gpu_proxy.compile_program(name, setup)
            finally:
                engine.COMPILER_OPTIONS["gpu"] = saved
        return dict(program=name, **control_flow(_thunk_text(dump)))


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    gpu_proxy.name_platform()
    ap = argparse.ArgumentParser(prog="python -m bench.command_buffers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, of {', '.join(PROGRAMS)}")
    ap.add_argument("--json", help="write the rows here (and the run's date, command, versions and load beside "
                    "it, FILE's name with .meta.json)")
    args = ap.parse_args(argv)
    names = [p for p in args.programs.split(",") if p]
    bad = [p for p in names if p not in PROGRAMS]
    if bad or not names:
        print(f"error: unknown program(s) {', '.join(bad) or '(none)'}; choose from {', '.join(PROGRAMS)}",
              file=sys.stderr)
        return 2
    problem = gpu_proxy.plugin_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    meta = gpu_proxy.provenance(argv, "bench.command_buffers")
    setup = gpu_proxy.make_setup(2) if any(n not in TOYS for n in names) else None
    rows = [measure(n, setup) for n in names]
    print("| program | control flow on the host | on the device |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['program']} | {r['on_host']} | {r['on_device']} |")
    if args.json:
        meta["uptime_after"] = gpu_proxy._output(["uptime"])
        for path, obj in ((args.json, rows), (gpu_proxy.meta_path(args.json), meta)):
            with open(path, "w") as f:
                json.dump(obj, f, indent=1)
                f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
