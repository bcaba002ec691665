"""The one prepared script for a lent GPU: every measurement the GPU-speed issue asks for, within a budget.

A device is lent to some tasks only, for minutes in all, so what runs on it is decided here, in the
repository, and tested on the CPU (``--smoke``). In order, each step a subprocess with its share of the time
left (a step that runs out is stopped and the next starts; its JSON says so):

1. ``before``: ``bench.gpu_check``'s step kinds at LLaDA-8B layer shapes compiled as they were before the
   engine set its GPU options (``--xla-defaults --refresh-buckets 4``);
2. ``after``: the same kinds as the engine compiles them now (cuBLAS GEMMs, one refresh width on a GPU);
3. ``blocks``: the engine's block program (dual cache and Polestar, fixed batch 1 and 32) on random weights at
   those shapes, its milliseconds per decode step (:func:`time_blocks`);
4. ``serve_tiny_tasks`` / ``serve_tiny_long``: the OpenAI server against the best fixed batch at concurrency
   32 on both trained test beds (``bench.serve_load``).

Every step writes its JSON into ``--out-dir`` (default ``bench/published/gpu``), and ``session.json`` there
lists the steps with their commands, seconds and exit codes::

    python -m bench.gpu_session                       # on the GPU: about 8 minutes
    python -m bench.gpu_session --smoke --out-dir /tmp/s   # the same steps at tiny sizes, any backend
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Each step's share of the budget (the rest of the time left goes to the last steps).
SHARES = {"before": 0.14, "after": 0.14, "blocks": 0.22, "serve_tiny_tasks": 0.25, "serve_tiny_long": 0.25}


def steps(out_dir: str, smoke: bool) -> list[tuple[str, list[str]]]:
    """``(name, argv)`` of every step (``python -m ...`` commands, run from the repository)."""
    py = [sys.executable, "-m"]
    check = ["bench.gpu_check", "--budget-s", "60"] + (["--smoke"] if smoke else [])
    serve = lambda n, out: (py + ["bench.serve_load", "--decoder", "polestar", "--concurrency", "4" if smoke else "32",
                                  "--fixed-batches", "4" if smoke else "32", "--n", str(8 if smoke else n),
                                  "--out", os.path.join(out_dir, out)])
    long = ["--model", os.path.join("polestar_jax", "assets", "tiny_long"), "--tasks", "long"]
    return [
        ("before", py + check + ["--xla-defaults", "--refresh-buckets", "4", "--out",
                                 os.path.join(out_dir, "gpu_check_before.json")]),
        ("after", py + check + ["--out", os.path.join(out_dir, "gpu_check_after.json")]),
        ("blocks", py + ["bench.gpu_session", "--blocks-only", "--out-dir", out_dir] + (["--smoke"] if smoke else [])),
        ("serve_tiny_tasks", serve(288, "serve_session_tiny_tasks.json")),
        ("serve_tiny_long", serve(144, "serve_session_tiny_long.json") + long),
    ]


def time_blocks(smoke: bool, batches: tuple[int, ...] = (1, 32), repeats: int = 3) -> list[dict]:
    """Milliseconds per decode step of the engine's block program for the dual cache and Polestar, on random
    bf16 weights at ``bench.gpu_check``'s shapes (4 layers of LLaDA-8B; ``smoke``: its tiny shapes): each
    fixed batch decodes its whole generation ``repeats`` times after one untimed run (the compile), and the
    median run's seconds are divided by the batch's forwards (its slowest row's, block by block)."""
    import numpy as np

    from bench import gpu_check
    from polestar_jax.config import DecodeConfig
    from polestar_jax.engine.engine import Engine

    cc = gpu_check.CheckConfig(layers=2 if smoke else 4, prompt_length=32 if smoke else 256,
                               gen_length=64 if smoke else 256, block_length=16 if smoke else 32, smoke=smoke)
    cfg, _ = gpu_check.model_config(cc)
    engine = Engine(gpu_check.make_params(cfg, cc.seed), cfg)
    rng = np.random.default_rng(cc.seed)
    dcfgs = {"dual": DecodeConfig(decoder="fastdllm", cache="dual", gen_length=cc.gen_length,
                                  block_length=cc.block_length, threshold=0.9, early_exit=False),
             "polestar": DecodeConfig(decoder="polestar", gen_length=cc.gen_length, block_length=cc.block_length,
                                      threshold=0.9, early_exit=False, polestar=gpu_check.polestar_config(cfg, cc))}
    rows = []
    for name, dcfg in dcfgs.items():
        for b in (1, 2) if smoke else batches:
            prompts = rng.integers(0, cfg.vocab_size - 1, size=(b, cc.prompt_length)).tolist()
            first = engine.run(prompts, dcfg, prompt_slot=cc.prompt_length)
            runs = [engine.run(prompts, dcfg, prompt_slot=cc.prompt_length) for _ in range(repeats)]
            res = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
            forwards = int(np.asarray(res.block_nfe).max(axis=0).sum())
            rows.append({"decoder": name, "batch": b, "layers": cfg.n_layers, "forwards": forwards,
                         "seconds": res.seconds, "ms_per_step": 1e3 * res.seconds / forwards,
                         "est_ms_per_step_32_layers": 1e3 * res.seconds / forwards * 32 / cfg.n_layers,
                         "compile_seconds": first.compile_seconds})
            print(f"[blocks] {name} batch {b}: {rows[-1]['ms_per_step']:.3f} ms a step ({forwards} forwards)",
                  file=sys.stderr, flush=True)
    return rows


def run_steps(out_dir: str, smoke: bool, budget_s: float, only: Optional[set] = None) -> list[dict]:
    """Runs the steps in order, each with its share of the time left; returns what each did."""
    done, end = [], time.monotonic() + budget_s
    todo = [s for s in steps(out_dir, smoke) if only is None or s[0] in only]
    for i, (name, argv) in enumerate(todo):
        left = end - time.monotonic()
        share = sum(SHARES[n] for n, _ in todo[i:])
        limit = max(5.0, left * SHARES[name] / share) if left > 0 else 0.0
        t0 = time.perf_counter()
        if limit <= 0:
            done.append({"step": name, "command": argv, "skipped": "no time left"})
            continue
        try:
            proc = subprocess.run(argv, cwd=REPO, timeout=limit, capture_output=True, text=True)
            rc, tail = proc.returncode, (proc.stderr or "")[-1500:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", str(e.stderr or "")[-1500:] if e.stderr else "timed out"
        done.append({"step": name, "command": " ".join(argv[2:]), "seconds": round(time.perf_counter() - t0, 1),
                     "limit_s": round(limit, 1), "returncode": rc, "stderr_tail": tail})
        print(f"[gpu_session] {name}: exit {rc} in {done[-1]['seconds']} s (limit {limit:.0f} s)", file=sys.stderr,
              flush=True)
    return done


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=os.path.join(REPO, "bench", "published", "gpu"))
    ap.add_argument("--budget-s", type=float, default=480.0, help="seconds for all the steps (default %(default)s)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on any backend (tests/test_gpu_check.py)")
    ap.add_argument("--steps", default="", help="comma list of steps to run (default: all): " + ", ".join(SHARES))
    ap.add_argument("--blocks-only", action="store_true", help=argparse.SUPPRESS)  # step 3, in its own process
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    import jax

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind), "load": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    if args.blocks_only:
        out = dict(meta, rows=time_blocks(args.smoke))
        with open(os.path.join(args.out_dir, "block_programs.json"), "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        return 0
    only = {s.strip() for s in args.steps.split(",") if s.strip()} or None
    if only and only - set(SHARES):
        ap.error(f"unknown step(s) {', '.join(sorted(only - set(SHARES)))} (choose from {', '.join(SHARES)})")
    meta["steps"] = run_steps(args.out_dir, args.smoke, args.budget_s, only)
    with open(os.path.join(args.out_dir, "session.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    return 0 if all(s.get("returncode") == 0 for s in meta["steps"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
