"""Does the scheduler overlap its host work with the device? Measured with a model whose times are known.

The fake model family (``bench/fake_family.py``) gives every forward about ``--device`` seconds of device
work (chained matmuls, calibrated here) and its tokenizer's every ``decode`` ``--host`` seconds of host time
(a sleep: the scheduler detokenizes each streaming row after each block). The same streaming jobs run
through the server's :class:`~polestar_jax.serving.scheduler.Scheduler` (Fast-dLLM without a cache: one
forward a block) three times, in one run: device work only, host work only, both. A block call with both
costs ``to_max`` times the larger of the two alone and ``to_sum`` times their sum: about ``max / sum`` when
the host's work hides behind the device's, 1.0 when they add up.

    python -m bench.scheduler_overlap --json bench/published/engine/scheduler_overlap.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import threading
import time

import jax

from bench.fake_family import B, CFG, PARAMS, LetterTokenizer, busy, registered
from polestar_jax.config import DecodeConfig
from polestar_jax.engine.engine import Engine
from polestar_jax.serving.scheduler import Job, Scheduler


def calibrate(seconds: float) -> int:
    """The :func:`~bench.fake_family.busy` iterations that take about ``seconds`` on this device."""
    if seconds <= 0:
        return 0
    fn = jax.jit(busy, static_argnums=1)
    x = jax.numpy.zeros((4,), jax.numpy.int32)
    fn(x, 64).block_until_ready()
    t0 = time.perf_counter()
    fn(x, 64).block_until_ready()
    return max(1, int(64 * seconds / (time.perf_counter() - t0)))


def measure(iters: int, host_per_row: float, rows: int = 4, jobs: int = 16, gen: int = 16) -> dict:
    """Seconds per block call of ``jobs`` streaming jobs (``gen`` tokens each, a block of 4 a forward) on
    ``rows`` slots, each forward ``iters`` matmuls on the device, each detokenization ``host_per_row`` s."""
    dcfg = DecodeConfig(decoder="fastdllm", cache="none", gen_length=gen, block_length=B)
    with registered(device_iters=iters):
        engine = Engine(PARAMS, CFG, tokenizer=LetterTokenizer(host_per_row))
        sched = Scheduler(engine, dcfg, max_batch=rows, prompt_slot=4, max_queue=jobs, sampling=False,
                          batch_wait=0.0, overlap=True).start()  # (the automatic rule may also pick it)
        try:
            done, left, lock = threading.Event(), [jobs], threading.Lock()

            def on_event(ev):
                if ev.kind in ("done", "error"):
                    with lock:
                        left[0] -= 1
                        if not left[0]:
                            done.set()

            t0, blocks0 = time.perf_counter(), sched.blocks_run
            for _ in range(jobs):
                sched.submit(Job(prompt=[3], gen_length=gen, on_event=on_event, stream=True))
            assert done.wait(600), "the jobs did not finish"
            wall, calls = time.perf_counter() - t0, sched.blocks_run - blocks0
        finally:
            sched.stop()
    return {"device_iters": iters, "host_s_per_row": host_per_row, "block_calls": calls, "wall_s": round(wall, 4),
            "per_call_s": round(wall / calls, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=float, default=0.04, help="seconds of device work per forward (calibrated)")
    ap.add_argument("--host", type=float, default=0.01, help="seconds of host time per streaming row and block")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    iters = calibrate(args.device)
    device = measure(iters, 0.0, args.rows, args.jobs)
    host = measure(0, args.host, args.rows, args.jobs)
    both = measure(iters, args.host, args.rows, args.jobs)
    d, h, x = device["per_call_s"], host["per_call_s"], both["per_call_s"]
    summary = {"device_s": d, "host_s": h, "both_s": x, "to_max": round(x / max(d, h), 3),
               "to_sum": round(x / (d + h), 3), "ideal_to_sum": round(max(d, h) / (d + h), 3)}
    print(f"a block call: device work alone {d:.4f} s, host work alone {h:.4f} s, both {x:.4f} s = "
          f"{summary['to_max']:.2f}x the larger, {summary['to_sum']:.2f}x the sum (overlapped: "
          f"{summary['ideal_to_sum']:.2f}x)")
    rows = [device, host, both]
    out = {"command": " ".join(["python -m bench.scheduler_overlap", *(sys.argv[1:] if argv is None else argv)]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "load": " ".join(f"{x:.2f}" for x in os.getloadavg()), "jax": jax.__version__,
           "machine": platform.machine(), "cpus": os.cpu_count(), "summary": summary, "rows": rows}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
