"""Where the compile seconds of the block programs go: tracing + lowering against XLA's compile, per decoder.

For each decoder and batch size, the block program the engine compiles (``Engine.block_program``'s jit, at
the prompt slot and lengths given) is traced and lowered (``jax.jit(...).lower``: JAX's time) and then
compiled (``.compile()``: XLA's time), in one process, without the persistent compilation cache; then the
same shape is compiled twice by ``generate --precompile`` in fresh processes sharing an empty persistent
cache folder (the bundled model only): the second run's seconds are the cache-hit cost, tracing and
lowering again plus loading the executable. Models: the bundled ``tiny_tasks``
or a random LLaDA-shaped model (``--random-layers``, ``--random-d-model``; also the LLaDA-8B layer shapes
with ``--llada8b-layers N``: d_model 4096, 32 heads, MLP 12288, vocab 126464, bf16).

    python -m bench.bench_compile                                   # tiny_tasks, batch 1
    python -m bench.bench_compile --random-layers 8 --random-d-model 512 --prompt 64 --gen 128 --block 32
    python -m bench.bench_compile --llada8b-layers 2 --prompt 64 --gen 128 --block 32 --decoders fastdllm-dual,polestar
    python -m bench.bench_compile --decoders fastdllm-dual,polestar,polestar-1width,polestar-lean,polestar-norefresh,polestar-skeleton

The output's ``kernel_cost`` (``--kernel-cost N``) is what one distinct kernel costs XLA on this backend
(:func:`kernel_cost`), the unit the programs' fusion counts are paid in.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

DECODERS = {"llada": dict(decoder="llada", cache="none"), "fastdllm-none": dict(decoder="fastdllm", cache="none"),
            "fastdllm-prefix": dict(decoder="fastdllm", cache="prefix"),
            "fastdllm-dual": dict(decoder="fastdllm", cache="dual", step_after_full_pass=False),
            "polestar": dict(decoder="polestar")}
#: Polestar with parts of its program left out (what each part costs to compile; tokens differ), as
#: ``PolestarConfig`` fields: one refresh width; the two settings that trade decode speed for compile time
#: (one refresh width and no windowed block start: every block starts with a full pass); no refresh (and
#: so no suffix commit); the skeleton: also no windowed block start and no early commit (the block start,
#: the k-means, the token drift and the steps).
ABLATIONS = {"polestar-1width": dict(refresh_buckets=1),
             "polestar-lean": dict(refresh_buckets=1, windowed_period=0),
             "polestar-norefresh": dict(refresh=False, suffix_precommit=False),
             "polestar-skeleton": dict(refresh=False, suffix_precommit=False, windowed_period=0, early_threshold=None)}


def ablation_flags(fields: dict) -> list:
    """The ``generate`` flags of an ablation's fields."""
    from polestar_jax.cli import flag_of
    from polestar_jax.config import PolestarConfig

    out = []
    for k, v in fields.items():
        flag = flag_of(PolestarConfig, k, v)
        out += [flag] if isinstance(v, bool) else [flag, "none" if v is None else str(v)]
    return out


def decoder_settings(name: str) -> dict:
    """``DecodeConfig`` fields of a name of :data:`DECODERS` or :data:`ABLATIONS`."""
    if name in DECODERS:
        return DECODERS[name]
    if name not in ABLATIONS:
        raise SystemExit(f"unknown decoder {name!r} (one of {', '.join([*DECODERS, *ABLATIONS])})")
    from polestar_jax.config import PolestarConfig

    return dict(decoder="polestar", polestar=PolestarConfig(**ABLATIONS[name]))


def decode_config(name: str, gen: int, block: int):
    """The ``DecodeConfig`` a row of the table compiles: the decoder's settings, one token a step for LLaDA
    (no threshold), the 0.9 threshold for the others."""
    from polestar_jax.config import DecodeConfig

    return DecodeConfig(gen_length=gen, block_length=block, steps=gen,
                        **{"threshold": None if name == "llada" else 0.9, **decoder_settings(name)})


def _model(args):
    from polestar_jax.config import ModelConfig
    from polestar_jax.models.llada import init_params

    if args.llada8b_layers:
        cfg = ModelConfig(d_model=4096, n_heads=32, n_kv_heads=32, n_layers=args.llada8b_layers, mlp_hidden_size=12288,
                          vocab_size=126464, embedding_size=126464, mask_token_id=126336, eos_token_id=126081,
                          pad_token_id=126081)
        params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
        return cfg, params, "llada8b-shaped, %d layers, bf16 (abstract weights)" % args.llada8b_layers
    if args.random_layers:
        d = args.random_d_model
        cfg = ModelConfig(d_model=d, n_heads=d // 64, n_kv_heads=d // 64, n_layers=args.random_layers,
                          mlp_hidden_size=4 * d, vocab_size=512, embedding_size=512, mask_token_id=500,
                          eos_token_id=1, pad_token_id=1)
        return cfg, init_params(cfg, jax.random.PRNGKey(0)), f"random, {args.random_layers} layers, d_model {d}"
    from polestar_jax.io.checkpoint import load_model
    from polestar_jax.io.tokenizer import bundled_model_dir

    cfg, params = load_model(bundled_model_dir())
    return cfg, params, "tiny_tasks"


def time_program(cfg, params, dcfg, batch: int, prompt: int) -> dict:
    """Lowering and XLA seconds of one block program (the engine's jit, abstract arguments), its StableHLO lines
    and the fusions of the optimized HLO."""
    from polestar_jax.decode.block import decode_block
    from polestar_jax.engine.engine import Engine
    from polestar_jax.decode.layout import init_decode_state

    eng = Engine(params, cfg)
    spec = eng.spec(dcfg)
    state = init_decode_state(cfg, dcfg, [[1] * prompt] * batch, prompt, dtype=jax.tree.leaves(params)[0].dtype,
                              abstract=True)
    knobs = jax.eval_shape(lambda: eng.knobs(dcfg))
    jitted = jax.jit(decode_block, static_argnames=("spec",), donate_argnames=("state",))
    jax.clear_caches()  # (JAX's in-memory caches would answer a program traced before in this process)
    t0 = time.perf_counter()
    lowered = jitted.lower(params, state, knobs, None, spec)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    hlo_ops = lowered.as_text().count("\n")
    text = compiled.as_text()
    fusions = len(re.findall(r"= [^\n]*? fusion\(", text))  # (XLA compiles one kernel per fusion)
    return {"lower_seconds": t1 - t0, "xla_seconds": t2 - t1, "total_seconds": t2 - t0, "stablehlo_lines": hlo_ops,
            "fusions": fusions, "distinct_fusions": distinct_fusions(text)}


def distinct_fusions(hlo: str) -> int:
    """The fusions of an optimized HLO module's text that differ in more than their names and source
    metadata (XLA compiles a kernel once for identical fused computations: :func:`kernel_cost`)."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            bodies[name] = []
        elif name is not None and line.startswith("  "):
            bodies[name].append(re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", line.strip())))
    called = re.findall(r"= [^\n]*? fusion\([^\n]*?calls=%?([\w.\-]+)", hlo)
    return len({"\n".join(bodies.get(c, [c])) for c in called})


def kernel_cost(n: int = 100) -> dict:
    """What XLA charges per kernel on this backend: one program of ``n`` small elementwise kernels of ``n``
    distinct shapes against one of ``n`` such kernels of a single shape (XLA compiles identical fusions
    once), each compiled after its lowering. The difference per kernel is the cost of one distinct kernel,
    whatever it computes: on the CPU it, not the model's size, sets a block program's compile time."""
    def seconds(shapes) -> float:
        f = lambda p, xs: [jnp.where(p, x * 2 + 1, x) for x in xs]
        args = (jax.ShapeDtypeStruct((), jnp.bool_), [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
        lowered = jax.jit(f).lower(*args)
        t0 = time.perf_counter()
        lowered.compile()
        return time.perf_counter() - t0

    seconds([(1, 1)])  # (XLA's first compile in a process pays its own set-up)
    distinct = seconds([(1, 4 + i, 8 + i % 3) for i in range(n)])
    same = seconds([(1, 4, 8)] * n)
    return {"kernels": n, "distinct_shapes_seconds": distinct, "one_shape_seconds": same,
            "ms_per_distinct_kernel": 1e3 * (distinct - same) / n}


def cache_hit(name: str, batch: int, args) -> dict:
    """The persistent cache as a user meets it: ``generate --precompile`` of this shape (bundled model) run
    twice in fresh processes sharing an empty cache folder; the second run's line says what its seconds
    were (tracing and lowering, then loading)."""
    flags = {"llada": ["--decoder", "llada"], "fastdllm-none": ["--decoder", "fastdllm", "--cache", "none"],
             "fastdllm-prefix": ["--decoder", "fastdllm", "--cache", "prefix"],
             "fastdllm-dual": ["--decoder", "fastdllm", "--cache", "dual"], "polestar": ["--decoder", "polestar"],
             **{k: ["--decoder", "polestar", *ablation_flags(v)] for k, v in ABLATIONS.items()}}
    cmd = [sys.executable, "-m", "polestar_jax.generate", *flags[name], "--gen-length", str(args.gen),
           "--block-length", str(args.block), "--precompile", f"{batch}x{args.prompt}", "--quiet"]
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "POLESTAR_JAX_CACHE": d}
        lines = [subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.strip()
                 for _ in range(2)]
    m = re.search(r"in ([\d.]+)s \(tracing and lowering ([\d.]+)s; (\d+) of", lines[1])
    if not m:
        raise SystemExit(f"unexpected --precompile output: {lines!r}")
    total, low, hits = float(m.group(1)), float(m.group(2)), int(m.group(3))
    return {"cache_hit_seconds": total, "cache_hit_lower_seconds": low, "cache_hit_load_seconds": total - low,
            "cache_hit": hits == 1, "cache_hit_command": " ".join(cmd[1:])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--decoders", default="fastdllm-dual,polestar")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--random-layers", type=int, default=0)
    ap.add_argument("--random-d-model", type=int, default=512)
    ap.add_argument("--llada8b-layers", type=int, default=0)
    ap.add_argument("--no-cache-hit", action="store_true", help="skip the persistent-cache hit measurement")
    ap.add_argument("--kernel-cost", type=int, default=100, metavar="N",
                    help="also time N distinct against N identical small kernels (XLA's cost per kernel; 0: skip)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    cfg, params, what = _model(args)
    rows = []
    for name in args.decoders.split(","):
        for b in (int(x) for x in args.batch.split(",")):
            dcfg = decode_config(name, args.gen, args.block)
            r = {"decoder": name, "batch": b, **time_program(cfg, params, dcfg, b, args.prompt)}
            if not args.no_cache_hit and not (args.llada8b_layers or args.random_layers):
                r.update(cache_hit(name, b, args))
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    base = {r["batch"]: r["total_seconds"] for r in rows if r["decoder"] == "fastdllm-dual"}
    for r in rows:
        if r["batch"] in base:
            r["vs_dual"] = r["total_seconds"] / base[r["batch"]]
    result = {"benchmark": "bench.bench_compile", "model": what, "prompt": args.prompt, "gen": args.gen,
              "block": args.block, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "load": " ".join(f"{x:.2f}" for x in os.getloadavg()), "jax": jax.__version__, "rows": rows}
    if args.kernel_cost:
        result["kernel_cost"] = kernel_cost(args.kernel_cost)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
