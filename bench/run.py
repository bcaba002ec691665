"""The accuracy-throughput benchmark (issue #6): every decoder on the same held-out task instances.

Runs, in ONE process and on the same instances of :mod:`bench.tasks` (held-out evaluation seeds), each
decoder of :data:`DECODERS` on a trained model (default: the bundled ``tiny_tasks`` model) and reports, per
decoder and per task:

* ``accuracy``: exact match (the task's scorer on the answer cut at the first end-of-text token);
* ``tpf``: tokens per forward as the paper counts them: non-EOS generated tokens / forwards;
* ``tps``: non-EOS generated tokens per second of the decode loop (compile excluded; instances decode in
  batches of ``--batch``, the same for every decoder, so rows of one run compare);
* ``nfe``: forwards per instance (mean);
* ``gflops_per_token``: FLOPs per generated position, from XLA's cost analysis of one forward of each kind
  (full pass, prefix/dual-cache step, Polestar step with and without refresh; see
  :func:`bench.bench_decoders.bench_forwards`) weighted by how often each decoder ran each kind;
* ``refresh_rate`` (Polestar): refresh steps / decode steps (forwards after the block-start passes), and
  early / suffix commits per instance.

Usage::

    python -m bench.run [--quick] [--out DIR] [--model DIR] [--n N] [--batch B] [--decoders a,b,...]

Writes ``DIR/results.json`` (a list of rows with ``decoder``, ``task`` -- ``"all"`` for the mean over tasks
--, ``accuracy``, ``tpf``, ``tps``, ``nfe`` and more), ``DIR/results.md`` (tables) and ``DIR/frontier.png``
(accuracy against tokens/s, one point per decoder; needs matplotlib from the ``bench`` extra, skipped with a
note otherwise). ``--quick`` (8 instances per task, FLOPs from the matmul formula) is a smoke run of a
few minutes; the full run uses 200 instances per task. Timings are wall-clock on whatever machine runs this:
compare rows of one run.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np

from bench import tasks as T
from bench.bench_decoders import _fmt, forwards_gflops
from polestar_jax.checkpoint import generation_defaults, load_model
from polestar_jax.config import DecodeConfig, ModelConfig, PolestarConfig
from polestar_jax.engine import generate
from polestar_jax.errors import PolestarError
from polestar_jax.tokenizer import Tokenizer, bundled_model_dir, load_tokenizer

__all__ = ["Decoder", "DECODERS", "RunConfig", "decode_config", "run", "markdown", "main"]

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(_REPO_ROOT, "bench", "results", "run")


@dataclasses.dataclass(frozen=True)
class Decoder:
    """One benchmarked decoder: a name and the :class:`DecodeConfig` fields that define it."""

    name: str
    decoder: str
    cache: str
    threshold: Optional[float]
    polestar: Optional[dict] = None  # PolestarConfig overrides
    doc: str = ""


#: Every decoder of the benchmark, in report order.
DECODERS: tuple[Decoder, ...] = (
    Decoder("llada", "llada", "none", None, doc="LLaDA's sampler, one token per forward (steps = gen length)"),
    Decoder("fastdllm", "fastdllm", "none", 0.9, doc="Fast-dLLM threshold 0.9, no cache"),
    Decoder("fastdllm-prefix", "fastdllm", "prefix", 0.9, doc="Fast-dLLM threshold 0.9, prefix cache"),
    Decoder("fastdllm-dual", "fastdllm", "dual", 0.9, doc="Fast-dLLM threshold 0.9, dual cache"),
    Decoder("polestar", "polestar", "dual", 0.9, doc="Polestar-Cache + Polestar-Commit (default knobs)"),
    Decoder("polestar-int8", "polestar", "dual", 0.9, {"offload_hidden": "int8"},
            doc="Polestar with the refresh hidden states stored int8 (host memory where supported)"),
)
DECODER_NAMES = tuple(d.name for d in DECODERS)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines one benchmark run."""

    model: str = ""  # model folder ("" = bundled default)
    n: int = 200  # instances per task
    tasks: tuple[str, ...] = T.TASK_NAMES
    decoders: tuple[str, ...] = DECODER_NAMES
    batch: int = 72
    gen_length: Optional[int] = None  # default: the model folder's generation defaults
    block_length: Optional[int] = None
    seed: int = 0
    flops: bool = True  # FLOPs from XLA's cost analysis (compiles each forward kind); False: matmul formula


QUICK = RunConfig(n=8, flops=False)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, label: str = ""):
        self.total, self.done, self.label, self.t0 = max(1, total), 0, label, time.perf_counter()
        self._draw()

    def update(self, n: int, label: Optional[str] = None) -> None:
        self.done += n
        if label is not None:
            self.label = label
        self._draw()

    def _draw(self) -> None:
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        el = time.perf_counter() - self.t0
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {el:6.0f}s {self.label[:40]:<40}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def decode_config(d: Decoder, gen_length: int, block_length: int) -> DecodeConfig:
    """The :class:`DecodeConfig` of decoder ``d`` (steps = gen length: llada commits one token per forward)."""
    pc = PolestarConfig(**(d.polestar or {}))
    return DecodeConfig(decoder=d.decoder, cache=d.cache, gen_length=gen_length, block_length=block_length,
                        steps=gen_length, threshold=d.threshold, polestar=pc)


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def run_decoder(params, mcfg: ModelConfig, tok: Tokenizer, d: Decoder, items: list[tuple[str, str, str]],
                gen_length: int, block_length: int, batch: int, slot: int, seed: int,
                bar: Optional[_Progress] = None) -> dict[str, Any]:
    """Decodes every (task, prompt, answer) item with decoder ``d`` in batches of ``batch`` rows (the last
    batch is padded with copies of its first prompt, so one executable serves the run); returns per-item
    outputs and counters plus the totals."""
    dcfg = decode_config(d, gen_length, block_length)
    out = {"output": [], "correct": [], "nfe": [], "non_eos": [], "refresh": [], "steps": [], "early": [],
           "suffix": []}
    seconds = compile_s = 0.0
    for chunk in _chunks(items, batch):
        prompts = [tok.chat_prompt_ids(p) for _, p, _ in chunk]
        prompts += [prompts[0]] * (batch - len(prompts))
        res = generate(params, mcfg, prompts, dcfg, seed=seed, prompt_slot=slot)
        seconds += res.seconds
        compile_s += res.compile_seconds
        for r, (task, prompt, _) in enumerate(chunk):
            toks = res.tokens[r]
            text = T.decode_answer(tok, toks)
            out["output"].append(text)
            out["correct"].append(T.score(task, prompt, text))
            out["nfe"].append(int(res.nfe[r]))
            out["non_eos"].append(int(np.sum((toks != mcfg.eos_token_id) & (toks != mcfg.pad_token_id))))
            if res.polestar is not None:
                ref = int(res.polestar["cluster_steps"][r].sum())
                starts = int(res.polestar["processed"][r].sum())
                out["refresh"].append(ref)
                out["steps"].append(int(res.nfe[r]) - starts)
                out["early"].append(int(res.polestar["early"][r]))
                out["suffix"].append(int(res.polestar["suffix"][r]))
        if bar is not None:
            bar.update(len(chunk))
    out["seconds"] = seconds
    out["compile_seconds"] = compile_s
    return out


def _forward_flops(params, mcfg: ModelConfig, slot: int, gen_length: int, block_length: int,
                   xla: bool) -> dict[str, float]:
    """GFLOP of one forward of each kind (batch 1) for this model and layout: from XLA's cost analysis of
    the compiled forward with the layer scan unrolled (``xla``; see
    :func:`bench.bench_decoders.bench_forwards`), else from the matmul formula (no compile)."""
    from bench import bench_decoders as BD

    if not xla:
        length = slot + gen_length
        r_rows = (PolestarConfig().prefix_blocks + PolestarConfig().suffix_blocks) * block_length
        q = {"full": length, "prefix_step": gen_length, "dual_step": block_length,
             "polestar_step": block_length, "polestar_refresh_step": block_length + r_rows}
        return {k: BD.analytic_flops(mcfg, rows, length, block_length) / 1e9 for k, rows in q.items()}
    bc = BD.BenchConfig(name="tasks", n_layers=mcfg.n_layers, d_model=mcfg.d_model, n_heads=mcfg.n_heads,
                        mlp_hidden=mcfg.mlp_hidden_size, vocab=mcfg.embedding_size, prompt_length=slot,
                        gen_length=gen_length, block_length=block_length, steps=gen_length, forward_warmup=0,
                        forward_reps=1, flops=True)
    prompt = [mcfg.eos_token_id] * slot
    return BD.gflops_by_kind(BD.bench_forwards(params, mcfg, prompt, bc))


def _row(d: Decoder, task: str, idx: Sequence[int], res: dict, seconds: float, flops_by: Optional[dict],
         n_blocks: int, gen_length: int) -> dict[str, Any]:
    sel = lambda key: [res[key][i] for i in idx] if res[key] else []
    nfe, non_eos = sum(sel("nfe")), sum(sel("non_eos"))
    row = {
        "decoder": d.name, "task": task, "n": len(idx),
        "accuracy": float(np.mean(sel("correct"))),
        "tpf": non_eos / max(1, nfe),
        "tps": non_eos / seconds if seconds > 0 else 0.0,
        "nfe": nfe / len(idx),
        "tpf_all_positions": gen_length * len(idx) / max(1, nfe),
        "non_eos_tokens": non_eos,
    }
    starts = len(idx) * n_blocks  # Fast-dLLM's cached decoders start every block with a full pass
    if d.decoder == "polestar":
        ref, steps = sum(sel("refresh")), sum(sel("steps"))
        starts = nfe - steps  # blocks Polestar processed (a block filled ahead by suffix commits has none)
        row.update(refresh_rate=ref / max(1, steps), refresh_steps=ref / len(idx),
                   early_commits=sum(sel("early")) / len(idx), suffix_commits=sum(sel("suffix")) / len(idx))
    else:
        ref = 0
    if flops_by is not None:
        gflops = forwards_gflops(d.decoder, d.cache, nfe, starts, ref, flops_by)
        row["gflops_per_token"] = gflops / (len(idx) * gen_length)  # per generated position
    return row


def run(rc: RunConfig, out_dir: Optional[str] = DEFAULT_OUT, command: str = "", progress: bool = True) -> dict:
    """Runs the benchmark; writes results.json / results.md / frontier.png into ``out_dir`` when given."""
    t_start = time.perf_counter()
    model_dir = rc.model or bundled_model_dir()
    mcfg, params = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    gd = generation_defaults(model_dir)
    gen_length = rc.gen_length if rc.gen_length is not None else gd.get("gen_length", 32)
    block_length = rc.block_length if rc.block_length is not None else gd.get("block_length", 8)
    if gen_length <= 0 or block_length <= 0 or gen_length % block_length:
        raise PolestarError(f"gen length {gen_length} must be a positive multiple of block length {block_length}")
    unknown = sorted(set(rc.decoders) - set(DECODER_NAMES))
    if unknown:
        raise PolestarError(f"unknown decoder(s) {', '.join(unknown)} (choose from {', '.join(DECODER_NAMES)})")
    bad_tasks = sorted(set(rc.tasks) - set(T.TASK_NAMES))
    if bad_tasks:
        raise PolestarError(f"unknown task(s) {', '.join(bad_tasks)} (choose from {', '.join(T.TASK_NAMES)})")
    decoders = [d for d in DECODERS if d.name in rc.decoders]
    items = [(task, p, a) for task in rc.tasks for p, a in T.eval_instances(task, rc.n)]
    longest = max(len(tok.chat_prompt_ids(p)) for _, p, _ in items)
    slot = -(-longest // 16) * 16
    batch = min(rc.batch, len(items))
    n_blocks = gen_length // block_length
    _log(f"[run] model {model_dir}: {mcfg.n_layers}L d{mcfg.d_model}; {len(rc.tasks)} tasks x {rc.n} instances; "
         f"gen {gen_length} block {block_length}; batch {batch}; prompt slot {slot}")
    flops_by = None
    try:
        _log("[run] FLOPs per forward kind (" + ("XLA cost analysis" if rc.flops else "matmul formula") + ")")
        flops_by = _forward_flops(params, mcfg, slot, gen_length, block_length, rc.flops)
    except Exception as e:  # noqa: BLE001 - FLOPs are a nice-to-have
        _log(f"[run] no FLOP counts: {type(e).__name__}: {e}")
    rows, per_item, timing = [], {}, {}
    bar = _Progress(len(items) * len(decoders)) if progress else None
    for d in decoders:
        if bar is not None:
            bar.update(0, d.name)
        res = run_decoder(params, mcfg, tok, d, items, gen_length, block_length, batch, slot, rc.seed, bar)
        timing[d.name] = {"decode_seconds": res["seconds"], "compile_seconds": res["compile_seconds"]}
        all_idx = list(range(len(items)))
        # tokens/s is a property of the whole decode loop (tasks are mixed in a batch): every row of a
        # decoder reports the decoder's overall tokens/s; accuracy / TPF / NFE are per task
        overall = _row(d, "all", all_idx, res, res["seconds"], flops_by, n_blocks, gen_length)
        for task in rc.tasks:
            idx = [i for i, it in enumerate(items) if it[0] == task]
            r = _row(d, task, idx, res, res["seconds"], flops_by, n_blocks, gen_length)
            r["tps"] = overall["tps"]
            rows.append(r)
        overall["accuracy"] = float(np.mean([r["accuracy"] for r in rows if r["decoder"] == d.name]))
        overall.update(timing[d.name])
        rows.append(overall)
        per_item[d.name] = res["output"]
    if bar is not None:
        bar.close()
    result = {
        "benchmark": "bench.run",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "model": model_dir,
        "config": dict(dataclasses.asdict(rc), gen_length=gen_length, block_length=block_length, batch=batch,
                       prompt_slot=slot),
        "decoders": {d.name: dict(dataclasses.asdict(d)) for d in decoders},
        "machine": _machine(),
        "notes": [
            "accuracy: exact match on held-out instances (bench.tasks eval seeds); 'all' = mean over tasks.",
            "tpf: non-EOS generated tokens / forwards (the paper's TPF); tpf_all_positions counts every "
            "generated position.",
            "tps: non-EOS generated tokens / decode-loop seconds of the decoder over all tasks (batched, "
            "compile excluded); the same value on every task row of a decoder.",
            "gflops_per_token: FLOPs of the forwards run / generated positions, per forward kind from "
            + ("XLA cost analysis of one compiled forward" if rc.flops else "the matmul formula")
            + " (windowed passes counted as full passes).",
        ],
        "rows": rows,
        "total_seconds": time.perf_counter() - t_start,
    }
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(rows, f, indent=2)
            f.write("\n")
        with open(os.path.join(out_dir, "run.json"), "w") as f:
            json.dump({k: v for k, v in result.items() if k != "rows"}, f, indent=2)
            f.write("\n")
        with open(os.path.join(out_dir, "results.md"), "w") as f:
            f.write(markdown(result) + "\n")
        result["plot"] = frontier_plot(rows, os.path.join(out_dir, "frontier.png"))
    return result


def _machine() -> dict:
    from bench.bench_decoders import machine_info

    return dict(machine_info(), loadavg=os.getloadavg() if hasattr(os, "getloadavg") else None)



def markdown(result: dict) -> str:
    rows = result["rows"]
    cfg = result["config"]
    names = list(result["decoders"])
    tasks = [t for t in cfg["tasks"]]
    overall = {r["decoder"]: r for r in rows if r["task"] == "all"}
    base = overall.get("llada")
    lines = [
        f"Model `{os.path.basename(result['model'].rstrip('/'))}`, {cfg['n']} held-out instances per task, "
        f"gen {cfg['gen_length']}, block {cfg['block_length']}, batch {cfg['batch']}; {result['date']}.",
        "",
        "| decoder | accuracy | TPF | tokens/s | speed-up | NFE | GFLOP/token | refresh rate | compile s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        r = overall[n]
        speed = r["tps"] / base["tps"] if base and base["tps"] > 0 else None
        lines.append(f"| {n} | {100 * r['accuracy']:.1f}% | {r['tpf']:.2f} | {r['tps']:.1f} | "
                     f"{_fmt(speed)}{'x' if speed is not None else ''} | {r['nfe']:.1f} | "
                     f"{_fmt(r.get('gflops_per_token'), '.4f')} | {_fmt(r.get('refresh_rate'))} | "
                     f"{r['compile_seconds']:.1f} |")
    lines += ["", "Accuracy per task (TPF in parentheses):", "",
              "| task | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    by = {(r["decoder"], r["task"]): r for r in rows}
    for t in tasks:
        cells = [f"{100 * by[(n, t)]['accuracy']:.1f}% ({by[(n, t)]['tpf']:.2f})" for n in names]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def frontier_plot(rows: list[dict], path: str) -> Optional[str]:
    """Accuracy against tokens/s, one point per decoder; returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("[run] matplotlib is not installed (pip install -e '.[bench]'): no frontier.png")
        return None
    pts = [r for r in rows if r["task"] == "all"]
    fig, ax = plt.subplots(figsize=(6, 4.2), dpi=120)
    markers = "osD^vP*X"
    for i, r in enumerate(pts):  # a legend, not labels: decoders with equal accuracy sit side by side
        ax.scatter(r["tps"], 100 * r["accuracy"], s=45, marker=markers[i % len(markers)],
                   label=f"{r['decoder']} (TPF {r['tpf']:.2f})")
    ax.legend(fontsize=7, loc="best")
    ax.set_xlabel("tokens/s (non-EOS, decode loop)")
    ax.set_ylabel("accuracy (%, mean over tasks)")
    ax.set_title("accuracy vs throughput")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 instances per task, FLOPs from the matmul formula")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output folder (default %(default)s)")
    ap.add_argument("--model", default="", help="model folder (default: the bundled trained model)")
    ap.add_argument("--n", type=int, default=None, help="instances per task (default 200, --quick 8)")
    ap.add_argument("--batch", type=int, default=RunConfig.batch, help="rows per decode batch")
    ap.add_argument("--tasks", default=None, help=f"comma-separated subset of {','.join(T.TASK_NAMES)}")
    ap.add_argument("--decoders", default=None, help=f"comma-separated subset of {','.join(DECODER_NAMES)}")
    ap.add_argument("--gen-length", type=int, default=None)
    ap.add_argument("--block-length", type=int, default=None)
    ap.add_argument("--no-flops", action="store_true", help="FLOPs from the matmul formula, not XLA")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    base = QUICK if args.quick else RunConfig()
    rc = dataclasses.replace(
        base, model=args.model, batch=args.batch, gen_length=args.gen_length, block_length=args.block_length,
        n=args.n if args.n is not None else base.n, flops=base.flops and not args.no_flops,
        tasks=tuple(args.tasks.split(",")) if args.tasks else base.tasks,
        decoders=tuple(args.decoders.split(",")) if args.decoders else base.decoders)
    if rc.n <= 0 or rc.batch <= 0:
        print("error: --n and --batch must be positive", file=sys.stderr)
        return 2
    command = "python -m bench.run " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    try:
        result = run(rc, args.out, command=command, progress=not args.no_progress)
    except PolestarError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(result))
    if args.out:
        print(f"\nwrote {os.path.join(args.out, 'results.json')}, results.md"
              + (", frontier.png" if result.get("plot") else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
