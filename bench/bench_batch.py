"""Tokens/s against batch size for the Fast-dLLM dual cache and Polestar, in one process.

    python -m bench.bench_batch [--batches 1,2,4,8,16] [--gen-length 64] [--variant peaked] [--out DIR]

Model: the "small" random config of :mod:`bench.bench_decoders` (8 layers, d_model 512, 8 heads, MLP 1408,
vocab 32000), its ``peaked`` variant by default (LM head x60, zero mask embedding: the threshold rule then
commits several tokens per forward). Every row of a batch gets its own random 64-token prompt; tokens/s counts
all generated positions of the batch over the decode loop's wall time (compile excluded).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import numpy as np

from bench.bench_decoders import BenchConfig, machine_info, make_params
from bench.common import RESULTS_DIR
from polestar_jax.config import DecodeConfig
from polestar_jax.engine.engine import Engine


def run(batches: list[int], gen_length: int, variant: str, decoders: list[str]) -> dict:
    bc = dataclasses.replace(BenchConfig(), gen_length=gen_length, steps=gen_length)
    cfg = bc.model_config()
    params = make_params(bc, cfg)[variant]
    rng = np.random.default_rng(bc.seed)
    prompts_all = [rng.integers(0, cfg.vocab_size - 2, size=bc.prompt_length).tolist() for _ in range(max(batches))]
    rows = []
    engine = Engine(params, cfg)
    for decoder in decoders:
        dc = DecodeConfig(decoder=decoder, cache="dual", gen_length=gen_length, block_length=bc.block_length,
                          threshold=bc.threshold, early_exit=False)  # every block: tokens = batch x gen length
        for b in batches:
            prompts = prompts_all[:b]
            first = engine.run(prompts, dc, seed=0, prompt_slot=bc.prompt_length)
            res = engine.run(prompts, dc, seed=0, prompt_slot=bc.prompt_length)  # timed, compiled
            tokens = b * gen_length
            row = {"decoder": decoder, "batch": b, "tokens_per_s": tokens / res.seconds,
                   "decode_seconds": res.seconds, "compile_seconds": first.compile_seconds,
                   "nfe_per_row": [int(n) for n in res.nfe], "mean_tpf": float(np.mean(gen_length / res.nfe))}
            rows.append(row)
            print(f"[batch] {decoder} b={b}: {row['tokens_per_s']:.1f} tokens/s (decode {res.seconds:.2f} s, "
                  f"mean TPF {row['mean_tpf']:.2f}, compile {first.compile_seconds:.1f} s)", file=sys.stderr,
                  flush=True)
    return {"benchmark": "bench_batch", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "machine": machine_info(), "variant": variant, "gen_length": gen_length,
        "prompt_length": bc.prompt_length, "block_length": bc.block_length, "rows": rows}


def markdown(result: dict) -> str:
    decoders = sorted({r["decoder"] for r in result["rows"]}, key=["fastdllm", "polestar"].index)
    batches = sorted({r["batch"] for r in result["rows"]})
    by = {(r["decoder"], r["batch"]): r for r in result["rows"]}
    lines = ["| decoder | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---|" + "---:|" * len(batches)]
    for d in decoders:
        lines.append(f"| {d} (tokens/s) | " + " | ".join(f"{by[(d, b)]['tokens_per_s']:.1f}" for b in batches) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_batch", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--variant", default="peaked", choices=["random", "peaked"])
    ap.add_argument("--decoders", default="fastdllm,polestar")
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    result = run([int(b) for b in args.batches.split(",")], args.gen_length, args.variant,
                 args.decoders.split(","))
    result["total_seconds"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_batch.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(markdown(result))
    print(f"\ntotal {result['total_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
