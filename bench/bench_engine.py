"""Fixed lockstep batches against the engine's continuous batching with early exit, on a trained test bed.

For each decoder, the same held-out task instances (``bench.tasks``, instance i keyed by (seed, i)) are
decoded twice in one process, after a warm-up that compiles both programs:

* **fixed**: consecutive batches of ``--batch`` rows (the last padded), every block of every row decoded
  (``Engine.run`` with ``early_exit=False``: the loop before the engine);
* **lockstep, early exit** (``--lockstep-early-exit``): the same fixed batches, each row stopping after its
  first stop token's block and the batch when its last row stops (a long answer holds its batch);
* **continuous**: one job on ``--batch`` slots (``Engine.generate``): a row stops after the first finished
  block that holds a stop token, and its slot takes the next instance at the next block boundary.

``--mixed N`` adds N long-answer instances (``copy:`` of 9 names: every block of the bundled model's
generation) spread evenly through the job: a few long answers among many short ones, where fixed batches
are at their worst.

Reported: tokens/s (non-EOS tokens of the response's blocks / decode seconds), TPF, NFE, block calls,
accuracy, and how many answers differ between the modes (must be 0: early exit never changes a response).

    python -m bench.bench_engine --model polestar_jax/assets/tiny_long --tasks long --n 50
    python -m bench.bench_engine --tasks tiny_tasks --n 100 --decoders polestar,fastdllm-dual-checked
    python -m bench.bench_engine --tasks tiny_tasks --n 100 --mixed 72 --lockstep-early-exit
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

from bench import tasks as T
from bench.common import RESULTS_DIR, load_bench_model, prompt_slot
from bench.run import DECODERS, TASK_GROUPS, decode_config


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def mixed_items(items: list, n_long: int, seed: int = 0) -> list:
    """``items`` with ``n_long`` long-answer instances (``copy:`` of 9 distinct names) spread evenly."""
    import numpy as np

    rng = np.random.default_rng(seed)
    longs = []
    for _ in range(n_long):
        names = [T.NAMES[i] for i in rng.choice(len(T.NAMES), size=9, replace=False)]
        longs.append(("copy", "copy: " + ",".join(names), ",".join(names)))
    out, step = list(items), max(1, (len(items) + n_long) // max(1, n_long))
    for k, it in enumerate(longs):
        out.insert(min(len(out), k * step + step // 2), it)
    return out


def measure(bm, d, items, batch: int, slot: int, lockstep_early: bool = False) -> dict:
    eng = bm.engine
    prompts = [bm.tok.chat_prompt_ids(p) for _, p, _ in items]
    dc_fixed = decode_config(d, bm.gen_length, bm.block_length, early_exit=False)
    dc_cont = dataclasses.replace(dc_fixed, early_exit=True)
    pad = lambda c: c + [c[0]] * (batch - len(c))
    chunks = [list(range(i, min(len(prompts), i + batch))) for i in range(0, len(prompts), batch)]
    eng.run([prompts[i] for i in pad(chunks[0])], dc_fixed, prompt_slot=slot)  # compile both programs first
    eng.generate(prompts[: batch + 1], dc_cont, batch_size=batch, prompt_slot=slot)  # (more than a batch: per-row)
    if lockstep_early:
        eng.run([prompts[i] for i in pad(chunks[0])], dc_cont, prompt_slot=slot)
    out = {}
    t0 = time.perf_counter()
    rows, calls = [], 0
    for c in chunks:
        res = eng.run([prompts[i] for i in pad(c)], dc_fixed, rows=pad(c), prompt_slot=slot)
        rows += [res.row(r, c[r]) for r in range(len(c))]
        calls += bm.gen_length // bm.block_length
    out["fixed"] = (rows, time.perf_counter() - t0, calls)
    if lockstep_early:  # the same batches with early exit: a batch runs until its last row stops
        t0 = time.perf_counter()
        rows, calls = [], 0
        for c in chunks:
            res = eng.run([prompts[i] for i in pad(c)], dc_cont, rows=pad(c), prompt_slot=slot)
            rows += [res.row(r, c[r]) for r in range(len(c))]
            calls += int(max(res.blocks))
        out["lockstep_early_exit"] = (rows, time.perf_counter() - t0, calls)
    t0 = time.perf_counter()
    job = eng.generate(prompts, dc_cont, batch_size=batch, prompt_slot=slot)
    out["continuous"] = (job.rows, time.perf_counter() - t0, job.block_calls)
    report, texts = {}, {}
    for mode, (rows, secs, calls) in out.items():
        comps = [eng.completion(r) for r in rows]
        texts[mode] = [bm.tok.decode(c.response_ids) for c in comps]
        tokens, nfe = sum(c.non_eos_tokens for c in comps), sum(c.nfe for c in comps)
        correct = [T.score(task, p, t) for (task, p, _), t in zip(items, texts[mode])]
        report[mode] = {"seconds": secs, "tokens_per_s": tokens / secs, "tpf": tokens / nfe, "nfe": nfe,
                        "non_eos_tokens": tokens, "block_calls": calls, "accuracy": sum(correct) / len(correct)}
    report["speedup"] = report["continuous"]["tokens_per_s"] / report["fixed"]["tokens_per_s"]
    if "lockstep_early_exit" in report:
        report["speedup_vs_lockstep_early_exit"] = (report["continuous"]["tokens_per_s"]
                                                    / report["lockstep_early_exit"]["tokens_per_s"])
    report["wall_speedup"] = report["fixed"]["seconds"] / report["continuous"]["seconds"]
    report["answers_differing"] = sum(a != b for m in texts for a, b in zip(texts["fixed"], texts[m]))
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="model folder (default: the bundled tiny_tasks)")
    ap.add_argument("--tasks", default="tiny_tasks", help="task group (tiny_tasks, long) or names")
    ap.add_argument("--n", type=int, default=100, help="instances per task")
    ap.add_argument("--batch", type=int, default=72)
    ap.add_argument("--decoders", default="fastdllm-dual-checked,polestar")
    ap.add_argument("--mixed", type=int, default=0, help="add this many long-answer instances (copy: of 9 names)")
    ap.add_argument("--lockstep-early-exit", action="store_true",
                    help="also run the fixed batches with early exit (a batch stops at its last row's end)")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "bench_engine.json"))
    args = ap.parse_args(argv)
    bm = load_bench_model(args.model or None)
    names = TASK_GROUPS.get(args.tasks, tuple(args.tasks.split(",")))
    items = [(t, p, a) for t in names for p, a in T.eval_instances(t, args.n)]
    if args.mixed:
        items = mixed_items(items, args.mixed)
    slot = prompt_slot([bm.tok.chat_prompt_ids(p) for _, p, _ in items])
    result = {"benchmark": "bench.bench_engine", "command": "python -m bench.bench_engine " + " ".join(argv or sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "load_before": _loadavg(), "model": bm.model_dir, "instances": len(items), "batch": args.batch,
              "long_instances_added": args.mixed,
              "gen_length": bm.gen_length, "block_length": bm.block_length, "decoders": {}}
    for name in args.decoders.split(","):
        d = next(x for x in DECODERS if x.name == name)
        r = measure(bm, d, items, args.batch, slot, args.lockstep_early_exit)
        result["decoders"][name] = r
        print(f"[{name}] fixed {r['fixed']['tokens_per_s']:.1f} tok/s (TPF {r['fixed']['tpf']:.2f}) | continuous "
              f"{r['continuous']['tokens_per_s']:.1f} tok/s (TPF {r['continuous']['tpf']:.2f}) | x{r['speedup']:.2f}"
              f" | answers differing {r['answers_differing']}"
              + (f" | lockstep with early exit {r['lockstep_early_exit']['tokens_per_s']:.1f} tok/s (x"
                 f"{r['speedup_vs_lockstep_early_exit']:.2f} for continuous)" if "lockstep_early_exit" in r else ""),
              file=sys.stderr, flush=True)
    result["load_after"] = _loadavg()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: {m: round(v[m]["tokens_per_s"], 1) for m in ("fixed", "continuous")} | {
        "speedup": round(v["speedup"], 3), "differing": v["answers_differing"]} for k, v in result["decoders"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
