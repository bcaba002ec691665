"""Load test of the OpenAI-compatible server against fixed batches of the same prompts.

For one model folder and one decoder: closed-loop clients (each sends its next request when its last one
answered) at each concurrency level send held-out task prompts (``bench.tasks``) to a real server
(``python -m polestar_jax.serve``, a subprocess, streaming requests), and the same prompts are decoded
in this process as today's fixed batches (``Engine.run`` on consecutive chunks, every block of every row:
the lockstep loop) and one request at a time. Reported per mode: completion tokens/s (response tokens over
wall seconds), requests/s, latency p50 / p95 / p99 and time to first block (server: to the first streamed
block; fixed batches: a request's latency is its batch's end, all requests submitted at time 0), the
server's block calls and how full they ran (its ``/metrics`` counters), the CPU seconds the clients (this
process) and the server used, and the server's resident memory before and after. The server and the fixed
batches never run at the same time: each of ``--repeat`` rounds runs every mode back to back (the server
idles while this process decodes the fixed batches), and the server's ratio to the best fixed batch is taken
within each round, then its median over the rounds (this machine's speed drifts by 10-30% over minutes).
Both processes hold the device meanwhile: on a GPU neither preallocates its memory
(``XLA_PYTHON_CLIENT_PREALLOCATE=false``); a TPU, which one process owns, cannot run it this way. The p99
ratio is of the median runs, not paired by round.

    python -m bench.serve_load --decoder polestar --concurrency 1,8,32 --n 144
    python -m bench.serve_load --model polestar_jax/assets/tiny_long --tasks long --max-batch 32
    python -m bench.serve_load --concurrency 32 --fixed-batches 32 --in-process 32   # + the scheduler alone
    python -m bench.serve_load --concurrency 32 --fixed-batches 32 --repeat 3        # 3 rounds: medians
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import datetime
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from typing import Optional

import numpy as np

from bench import tasks as T
from bench.common import REPO_ROOT, RESULTS_DIR
from bench.run import TASK_GROUPS


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _cpu_seconds(pid: Optional[int] = None) -> float:
    """CPU seconds (user + system) of process ``pid`` (None: this one, threads included)."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _counters(base: str) -> dict:
    """The server's block-call counters (``/metrics``)."""
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    get = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
    return {"block_calls": get("polestar_block_calls_total"), "row_blocks": get("polestar_row_blocks_total")}


def percentiles(xs) -> dict:
    a = np.asarray(xs, float)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 95, 99)} if a.size else {}


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s among repeated ones (an odd count: the middle one), with every run's
    tokens/s in ``tokens_per_s_runs``: this machine varies by 10-20% from run to run."""
    runs = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**runs[(len(runs) - 1) // 2], "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


def paired_ratio(rnd: dict, mode: str, concurrency: int) -> float:
    """A round's tokens/s of ``mode`` ("server", "in_process") at ``concurrency`` over the best fixed batch of
    the same round (measured minutes apart, the two would differ by the machine's drift as well)."""
    return rnd[mode][concurrency]["tokens_per_s"] / max(r["tokens_per_s"] for r in rnd["fixed"].values())


def start_server(model: str, decoder: str, max_batch: int, max_queue: int, prompt_tokens: int,
                 extra: tuple = ()) -> tuple:
    cmd = [sys.executable, "-m", "polestar_jax.serve", "--port", "0", "--decoder", decoder, "--max-batch",
           str(max_batch), "--max-queue", str(max_queue), "--max-prompt-tokens", str(prompt_tokens), "--quiet",
           *extra]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    line = proc.stdout.readline()
    m = re.search(r"at (http://[\d.]+:\d+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r} {proc.stderr.read()[-2000:]}")
    compiled = float(re.search(r"compiled in ([\d.]+)s", line).group(1))
    return proc, m.group(1), compiled


def run_clients(base: str, name: str, messages: list[str], concurrency: int) -> dict:
    """Closed loop: ``concurrency`` clients share the request list; streaming chat requests. The clients are
    coroutines on one event loop over aiohttp (as in vLLM's serving benchmark): on a small machine they share
    the server's cores, and ``client_cpu_seconds`` reports what they took (288 streaming requests at
    concurrency 8 and up on the 2-core CPU: 0.06-0.16 s, against 0.7-0.9 s with httpx's client and about
    twice that with 32 threads)."""
    return asyncio.run(_clients(base, name, messages, concurrency))


async def _clients(base: str, name: str, messages: list[str], concurrency: int) -> dict:
    import aiohttp

    todo = list(range(len(messages)))
    lat, ttfb, tokens = [], [], []

    async def client(http):
        while todo:
            i = todo.pop(0)
            t0 = time.perf_counter()
            first = None
            async with http.post(base + "/v1/chat/completions",
                                 json={"model": name, "stream": True, "stream_options": {"include_usage": True},
                                       "messages": [{"role": "user", "content": messages[i]}]}) as r:
                r.raise_for_status()  # (an error reply is not a request with no tokens)
                async for raw in r.content:  # (one server-sent-event line at a time)
                    line = raw.decode().rstrip("\r\n")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    body = json.loads(line[6:])
                    if first is None and body.get("choices") and body["choices"][0]["delta"].get("content"):
                        first = time.perf_counter() - t0
                    if body.get("usage"):
                        tokens.append(body["usage"]["completion_tokens"])
            lat.append(time.perf_counter() - t0)
            ttfb.append(first if first is not None else lat[-1])

    t0 = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*[client(http) for _ in range(concurrency)])
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": len(lat), "completion_tokens": int(sum(tokens)),
            "seconds": wall, "tokens_per_s": sum(tokens) / wall, "requests_per_s": len(lat) / wall,
            "latency": percentiles(lat), "time_to_first_block": percentiles(ttfb)}


_MODELS: dict = {}


def _model(model_dir: Optional[str]):
    """The model of ``model_dir`` loaded once in this process (its engine keeps the compiled programs)."""
    from polestar_jax.api import load

    if model_dir not in _MODELS:
        _MODELS[model_dir] = load(model_dir)
    return _MODELS[model_dir]


def scheduler_clients(model_dir: Optional[str], decoder: str, messages: list[str], concurrency: int,
                      max_batch: int, prompt_tokens: int, batch_wait: Optional[float] = None) -> dict:
    """The server's engine and scheduler without HTTP, in this process: the same closed loop of streaming
    jobs (``concurrency`` client threads submitting to a :class:`polestar_jax.serving.scheduler.Scheduler` on the
    sampling program, as the server runs), so the HTTP layer's share of the server's seconds shows."""
    from polestar_jax.serving.scheduler import Job, Scheduler

    m = _model(model_dir)
    dcfg = m.decode_config(decoder=decoder)
    kw = {} if batch_wait is None else {"batch_wait": batch_wait}
    sched = Scheduler(m.engine, dcfg, max_batch, prompt_tokens, max_queue=2 * concurrency, **kw).start()
    todo, lock, lat, tokens = list(range(len(messages))), threading.Lock(), [], []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            done, out = threading.Event(), {}

            def on_event(ev, out=out, done=done):
                if ev.kind in ("done", "error"):
                    out["ev"] = ev
                    done.set()

            t0 = time.perf_counter()
            sched.submit(Job(prompt=m.prompt_ids(messages[i]), gen_length=dcfg.gen_length, on_event=on_event,
                             stream=True))
            done.wait()
            with lock:
                lat.append(time.perf_counter() - t0)
                tokens.append(len(out["ev"].completion.response_ids) if out["ev"].completion else 0)

    try:
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(concurrency) as ex:
            for f in [ex.submit(client) for _ in range(concurrency)]:
                f.result()
        wall = time.perf_counter() - t0
    finally:
        sched.stop()
    return {"concurrency": concurrency, "requests": len(lat), "completion_tokens": int(sum(tokens)),
            "seconds": wall, "tokens_per_s": sum(tokens) / wall, "requests_per_s": len(lat) / wall,
            "latency": percentiles(lat), "blocks_run": sched.blocks_run}


def fixed_batches(model_dir: Optional[str], decoder: str, messages: list[str], batch: int) -> dict:
    """Today's lockstep fixed batches in this process: consecutive chunks of ``batch`` prompts, every block
    of every row; all requests submitted at time 0 (a request's latency: its batch's end)."""
    m = _model(model_dir)
    dcfg = m.decode_config(decoder=decoder, early_exit=False)
    ids = [m.prompt_ids(t) for t in messages]
    slot = m.engine.prompt_slot([len(p) for p in ids])
    chunks = [list(range(i, min(len(ids), i + batch))) for i in range(0, len(ids), batch)]
    pad = lambda c: c + [c[0]] * (batch - len(c))
    m.engine.run([ids[i] for i in pad(chunks[0])], dcfg, prompt_slot=slot)  # compile outside the clock
    lat, tokens = [], 0
    t0 = time.perf_counter()
    for c in chunks:
        res = m.engine.run([ids[i] for i in pad(c)], dcfg, rows=pad(c), prompt_slot=slot)
        end = time.perf_counter() - t0
        for r in range(len(c)):
            tokens += len(m.engine.completion(res.row(r)).response_ids)
            lat.append(end)
    wall = time.perf_counter() - t0
    return {"batch": batch, "requests": len(ids), "completion_tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "requests_per_s": len(ids) / wall, "latency": percentiles(lat),
            "time_to_first_block": percentiles(lat)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="model folder (default: the bundled tiny_tasks)")
    ap.add_argument("--tasks", default="tiny_tasks", help="task group (tiny_tasks, long) or task names")
    ap.add_argument("--decoder", default="polestar")
    ap.add_argument("--n", type=int, default=144, help="requests per concurrency level")
    ap.add_argument("--concurrency", default="1,8,32,72")
    ap.add_argument("--max-batch", type=int, default=32, help="the server's rows")
    ap.add_argument("--fixed-batches", default="1,32,72", help="fixed batch sizes to compare (1: one at a time)")
    ap.add_argument("--memory-requests", type=int, default=0, help="extra requests for the memory check (0: none)")
    ap.add_argument("--in-process", default="", help="concurrency levels to run on the scheduler without HTTP, "
                                                     "in this process (e.g. 32)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds, each running every level and fixed batch back to "
                                                           "back; the run of median tokens/s is reported (all in "
                                                           "*_runs), and the median of the rounds' ratios")
    ap.add_argument("--batch-wait", type=float, default=None,
                    help="the server's (and the in-process scheduler's) --batch-wait (default: the server's)")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "serve_load.json"))
    args = ap.parse_args(argv)
    # the fixed batches run in this process while the server (a child: it inherits this) lives: on a GPU
    # neither may take most of the device's memory up front, as JAX does by default (set before JAX starts)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    names = TASK_GROUPS.get(args.tasks, tuple(args.tasks.split(",")))
    per = -(-args.n // len(names))
    messages = [p for t in names for p, _ in T.eval_instances(t, per)][: args.n]
    levels = [int(c) for c in args.concurrency.split(",")]
    result = {"benchmark": "bench.serve_load", "command": "python -m bench.serve_load " + " ".join(argv or sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "load_before": _loadavg(), "model": args.model or "tiny_tasks", "decoder": args.decoder,
              "max_batch": args.max_batch, "server": [], "fixed": []}
    from polestar_jax.io.tokenizer import bundled_model_dir, load_tokenizer

    tok = load_tokenizer(args.model or bundled_model_dir())
    slot = -(-max(len(tok.chat_prompt_ids(m)) for m in messages) // 16) * 16  # the fixed batches' slot
    result["prompt_slot"] = slot
    extra = () if args.batch_wait is None else ("--batch-wait", str(args.batch_wait))
    proc, base, compiled = start_server(args.model, args.decoder, args.max_batch, max(levels) * 2, slot, extra)
    name = os.path.basename(os.path.normpath(args.model)) if args.model else "tiny_tasks"
    batches = [int(x) for x in args.fixed_batches.split(",")]
    in_process = [int(x) for x in args.in_process.split(",") if x.strip()]
    rounds: list[dict] = []  # one per --repeat: every mode measured back to back (the server idles meanwhile)
    try:
        result["server_compile_seconds"] = compiled
        run_clients(base, name, messages[: min(8, len(messages))], 4)  # warm-up
        rss0 = _rss_kib(proc.pid)
        for k in range(args.repeat):
            rnd: dict = {"server": {}, "fixed": {}, "in_process": {}}
            for c in levels:
                before, cpu = _counters(base), (_cpu_seconds(), _cpu_seconds(proc.pid))
                r = run_clients(base, name, messages, c)
                after = _counters(base)
                calls = after["block_calls"] - before["block_calls"]
                # how full the running batch ran, and the CPU the clients (this process) and the server used
                r["block_calls"] = int(calls)
                r["occupancy"] = (after["row_blocks"] - before["row_blocks"]) / max(1.0, calls) / args.max_batch
                r["client_cpu_seconds"] = _cpu_seconds() - cpu[0]
                r["server_cpu_seconds"] = _cpu_seconds(proc.pid) - cpu[1]
                rnd["server"][c] = r
                print(f"[round {k + 1} server c={c}] {r['tokens_per_s']:.1f} tok/s, {r['requests_per_s']:.2f} req/s, "
                      f"p50/p99 {r['latency']['p50']:.2f}/{r['latency']['p99']:.2f}s, ttfb p50 "
                      f"{r['time_to_first_block']['p50']:.2f}s, {r['block_calls']} block calls "
                      f"{100 * r['occupancy']:.0f}% full, CPU s clients {r['client_cpu_seconds']:.1f} server "
                      f"{r['server_cpu_seconds']:.1f} of {r['seconds']:.1f} s", file=sys.stderr, flush=True)
            for b in batches:
                r = rnd["fixed"][b] = fixed_batches(args.model or None, args.decoder, messages, b)
                print(f"[round {k + 1} fixed b={b}] {r['tokens_per_s']:.1f} tok/s, p99 {r['latency']['p99']:.2f}s",
                      file=sys.stderr, flush=True)
            for c in in_process:
                r = rnd["in_process"][c] = scheduler_clients(args.model or None, args.decoder, messages, c,
                                                             args.max_batch, slot, args.batch_wait)
                print(f"[round {k + 1} scheduler without HTTP c={c}] {r['tokens_per_s']:.1f} tok/s, p99 "
                      f"{r['latency']['p99']:.2f}s", file=sys.stderr, flush=True)
            rounds.append(rnd)
        if args.memory_requests:
            mem = messages * (-(-args.memory_requests // len(messages)))
            run_clients(base, name, mem[: args.memory_requests], 16)
        result["server_rss_kib"] = {"after_warmup": rss0, "after": _rss_kib(proc.pid),
                                    "requests": args.n * len(levels) * args.repeat + args.memory_requests}
    finally:
        proc.terminate()
        result["server_exit"] = proc.wait(120)
    result["load_after"] = _loadavg()
    result["fixed"] = [median_run([rnd["fixed"][b] for rnd in rounds]) for b in batches]
    best = max(result["fixed"], key=lambda r: r["tokens_per_s"])
    for mode in ("server", "in_process"):
        result[mode] = []
        for c in (levels if mode == "server" else in_process):
            r = median_run([rnd[mode][c] for rnd in rounds])
            # the ratio within each round (back to back: this machine's speed drifts over minutes), median over rounds
            ratios = sorted(paired_ratio(rnd, mode, c) for rnd in rounds)
            r["vs_best_fixed_tokens_per_s"] = float(np.median(ratios))
            r["vs_best_fixed_runs"] = ratios
            if mode == "server":
                r["p99_vs_best_fixed"] = r["latency"]["p99"] / best["latency"]["p99"]
            result[mode].append(r)
            print(f"[{mode} c={c}] median {r['tokens_per_s']:.1f} tok/s, {r['vs_best_fixed_tokens_per_s']:.2f}x the "
                  f"best fixed batch of its round (rounds: {', '.join(f'{x:.2f}' for x in ratios)})",
                  file=sys.stderr, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({"server": [(r["concurrency"], round(r["tokens_per_s"], 1), round(r["vs_best_fixed_tokens_per_s"], 2),
                                  round(r["latency"]["p99"], 2)) for r in result["server"]],
                      "fixed": [(r["batch"], round(r["tokens_per_s"], 1), round(r["latency"]["p99"], 2))
                                for r in result["fixed"]], "rss_kib": result["server_rss_kib"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
