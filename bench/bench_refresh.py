"""Rows a Polestar refresh computes and moves, by number of width buckets (issue #4).

A refresh stage runs at the smallest compiled width that holds every batch row's selected rows
(:mod:`polestar_jax.decode.polestar.compaction`, ``PolestarConfig.refresh_buckets``). This runs Polestar on the trained tiny
model over the same held-out task instances for each bucket count and batch size, and reports per refresh
step (steps where some row of the batch refreshes):

* ``moved_frac``: store rows read per layer (stages 1 + 2: what crosses from a host store to the device) /
  ``R`` (the window rows a dense refresh reads per layer);
* ``computed_frac``: refresh rows that go through attention + MLP per layer (stage 3's width) / ``R``;
* ``selected_frac``: rows actually selected (mean over refreshing rows) / ``R`` -- the floor for both;
* ``rows_differ``: instances whose tokens differ from the 1-bucket (dense) run -- the result must not depend
  on the bucket count;
* ``compile_s`` (of the block executable) and ``decode_s`` (decode loop, compile excluded).

Usage::

    python -m bench.bench_refresh [--quick] [--out DIR] [--buckets 1,2,4,8] [--batches 72,1] [--n N]

Writes ``DIR/bench_refresh.json`` (default ``bench/results/``) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Optional, Sequence

import numpy as np

from bench import tasks as T
from bench.common import RESULTS_DIR, decode_batches, load_bench_model, prompt_slot
from bench.run import DECODERS, decode_config
from polestar_jax.decode.polestar import compaction as RF
from polestar_jax.config import OFFLOAD_HIDDEN, PolestarConfig

DEFAULT_OUT = RESULTS_DIR


def accounting(steps: Sequence, pc: PolestarConfig, n_rows: int) -> dict:
    """Sums over the StepOut buffers of a run (each with ``cluster`` [S, b], ``moved_rows`` and
    ``refreshed_rows`` [S, b, N], numpy): refresh steps, and per refreshing layer the rows moved, the rows
    computed (stage 3's width: the smallest nonzero width of ``RF.widths(pc, n_rows)`` holding the batch's
    largest selection) and the rows selected (mean over the refreshing batch rows)."""
    ws = np.asarray(RF.widths(pc, n_rows)[1:])  # stage 3 has no width 0
    n = moved = computed = selected = 0.0
    for st in steps:
        cl = np.asarray(st.cluster)  # [S, b]
        mv, rr = np.asarray(st.moved_rows), np.asarray(st.refreshed_rows)  # [S, b, N]
        for s in np.nonzero(cl.any(axis=1))[0]:
            rows = cl[s]
            n += 1
            moved += mv[s][rows].max(axis=0).sum()  # one value per layer for the whole batch
            biggest = rr[s].max(axis=0)  # [N]
            computed += ws[np.searchsorted(ws, biggest)].sum()
            selected += rr[s][rows].mean(axis=0).sum()
    n_layers = np.asarray(steps[0].moved_rows).shape[-1] if steps else 1
    per = lambda x: float(x / max(n, 1) / (n_layers * n_rows))
    return {"refresh_steps": int(n), "moved_frac": per(moved), "computed_frac": per(computed),
            "selected_frac": per(selected)}


def run(buckets=(1, 2, 4, 8), batches=(72, 1), n: int = 16, model: Optional[str] = None,
        offload_hidden: str = "none") -> list[dict]:
    """One row per (batch size, bucket count): the :func:`accounting` fractions, ``rows_differ`` against the
    1-bucket (dense) run, which always runs first, and compile / decode seconds. Instance i decodes as row i
    of the job in every batch (:func:`bench.common.decode_batches`); the last batch is padded with copies of
    its first prompt, and the padding rows count in the accounting (the executable does their work)."""
    buckets = (1,) + tuple(q for q in buckets if q != 1)
    bm = load_bench_model(model)
    mcfg, params, tok, gen, block = bm.mcfg, bm.params, bm.tok, bm.gen_length, bm.block_length
    polestar = next(d for d in DECODERS if d.name == "polestar")
    items = [(t, p) for t in T.TASK_NAMES for p, _ in T.eval_instances(t, n)]
    prompts = [tok.chat_prompt_ids(p) for _, p in items]
    slot = prompt_slot(prompts)
    base = decode_config(polestar, gen, block)
    r_rows = (base.polestar.prefix_blocks + base.polestar.suffix_blocks) * block
    out = []
    for batch in batches:
        dense = None
        for q in buckets:
            pc = dataclasses.replace(base.polestar, refresh_buckets=q, offload_hidden=offload_hidden)
            dcfg = dataclasses.replace(base, polestar=pc)
            toks, steps, decode_s, compile_s = [], [], 0.0, 0.0
            for _, n_real, res in decode_batches(bm.engine, prompts, dcfg, batch, slot, seed=0):
                toks.append(res.tokens[:n_real])
                steps += list(res.steps)  # (padding rows included: the executable does their work)
                decode_s += res.seconds
                compile_s += res.compile_seconds
            toks = np.concatenate(toks)
            dense = toks if dense is None else dense
            row = {"batch": batch, "buckets": q, "widths": list(RF.widths(pc, r_rows)), "R": r_rows,
                   "offload_hidden": offload_hidden, "instances": len(prompts),
                   **accounting(steps, pc, r_rows),
                   "rows_differ": int((toks != dense).any(axis=1).sum()),
                   "compile_s": round(compile_s, 2), "decode_s": round(decode_s, 2)}
            print(json.dumps(row), file=sys.stderr, flush=True)
            out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    """The rows of :func:`run` as a markdown table."""
    lines = ["| batch | buckets | widths | refresh steps | rows read / R | rows computed / R | rows selected / R "
             "| instances differing | compile s | decode s |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['buckets']} | {','.join(map(str, r['widths']))} | {r['refresh_steps']} | "
                     f"{r['moved_frac']:.3f} | {r['computed_frac']:.3f} | {r['selected_frac']:.3f} | "
                     f"{r['rows_differ']} | {r['compile_s']:.1f} | {r['decode_s']:.1f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_refresh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="defaults: 2 instances per task, buckets 1,4, batch 4")
    ap.add_argument("--buckets", default=None, help="bucket counts (default 1,2,4,8; 1 always runs, first)")
    ap.add_argument("--batches", default=None, help="batch sizes (default 72,1)")
    ap.add_argument("--n", type=int, default=None, help="instances per task (default 16)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--offload-hidden", default="none", choices=list(OFFLOAD_HIDDEN))
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    quick = args.quick
    try:
        ints = lambda s, full, small: tuple(int(x) for x in s.split(",")) if s else (small if quick else full)
        buckets, batches = ints(args.buckets, (1, 2, 4, 8), (1, 4)), ints(args.batches, (72, 1), (4,))
    except ValueError:
        ap.error("--buckets and --batches take comma-separated integers")
    n = args.n if args.n is not None else (2 if quick else 16)
    if min(buckets) < 1 or min(batches) < 1 or n < 1:
        ap.error("buckets, batches and --n must be >= 1")
    rows = run(buckets, batches, n, args.model, args.offload_hidden)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_refresh.json")
    with open(path, "w") as f:
        json.dump({"command": "python -m bench.bench_refresh " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "rows": rows}, f, indent=1)
    print(markdown(rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
