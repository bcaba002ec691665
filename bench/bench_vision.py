"""LLaDA-V's decoders on the trained vision test bed (issue #46 item 5): accuracy, TPF and tokens/s on held-out
pictures.

Runs, in one process and on the same held-out instances of :mod:`bench.tasks.shapes` (scene seeds >= 10^9;
``--n`` per task, a picture and its question through the user path: :meth:`polestar_jax.api.Model.image_prompts`),
each decoder of :data:`DECODERS` on a trained LLaDA-V folder (default: the bundled ``tiny_vision``):

* ``polestar_v``: LLaDA-V's own Polestar (the official code's variant: prefix cache, one k-means over the final
  hidden states of the whole multimodal prompt, drift-gated refresh and early commit; threshold 0.9);
* ``fastdllm-prefix``: Fast-dLLM's prefix cache at threshold 0.9 (``polestar_v`` without its clustering);
* ``fastdllm-dual``: Fast-dLLM's dual cache at 0.9 (the reference loop);
* ``polestar``: the LLaDA path's Polestar on the dual cache (the image rows are prompt rows);
* ``llada``: the one-token-per-forward sampler (the accuracy reference).

Per decoder and task: ``accuracy`` (exact match against the scene's answer), ``tpf`` (non-EOS generated tokens /
forwards), ``tps`` (non-EOS generated tokens per second of the decode loop; compile excluded, the median of
``--repeats`` decodes of the whole job, every decoder in batches of ``--batch`` rows at one prompt slot) and
``nfe`` (forwards per instance). Timings are wall-clock on whatever machine runs this: compare rows of one
run; ``run.json`` records the load before and after.

Usage::

    python -m bench.bench_vision [--model DIR] [--n 50] [--batch 8] [--repeats 3] [--decoders a,b,...]
                                 [--out bench/published/tiny_vision]
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import sys
import time
from typing import Optional, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.run import DECODERS as TEXT_DECODERS  # noqa: E402
from bench.run import Decoder, _machine, decode_config  # noqa: E402
from bench.tasks import decode_answer  # noqa: E402
from bench.tasks import shapes as S  # noqa: E402
from polestar_jax import cli  # noqa: E402
from polestar_jax.errors import PolestarError  # noqa: E402

__all__ = ["DECODERS", "instances", "run", "markdown", "main"]

_TEXT = {d.name: d for d in TEXT_DECODERS}
#: The decoders of the run, in report order.
DECODERS: tuple[Decoder, ...] = (
    Decoder("polestar_v", "polestar_v", "prefix", 0.9,
            doc="LLaDA-V's Polestar (the official variant: prefix cache, k-means over final hidden states)"),
    _TEXT["fastdllm-prefix"],
    _TEXT["fastdllm-dual"],
    _TEXT["polestar"],
    _TEXT["llada"],
)
DECODER_NAMES = tuple(d.name for d in DECODERS)
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "polestar_jax", "assets",
                             "tiny_vision")


def _uptime() -> Optional[str]:
    """``uptime``'s line (the load the timings ran under), None where it is missing."""
    import subprocess

    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def instances(n: int, tasks: Sequence[str] = S.TASK_NAMES) -> list[S.Instance]:
    """The held-out instances of the run: ``n`` per task, task-major."""
    return [inst for t in tasks for inst in S.eval_instances(t, n)]


def _decode(model, d: Decoder, ids, rows, insts, batch: int, slot: int, seed: int) -> dict:
    """One decode of the whole job with decoder ``d`` in padded batches of ``batch`` rows (instance i is row i
    of the job); per-instance outputs, forwards and non-EOS tokens, and the decode seconds."""
    gen = model.engine
    dcfg = decode_config(d, model.decode_config().gen_length, model.decode_config().block_length)
    out = {"output": [], "correct": [], "nfe": [], "non_eos": [], "seconds": 0.0, "compile_seconds": 0.0}
    for start in range(0, len(ids), batch):
        n_real = min(batch, len(ids) - start)
        pad = batch - n_real
        res = gen.run(list(ids[start:start + n_real]) + [ids[start]] * pad, dcfg, seed=seed,
                      rows=list(range(start, start + batch)), prompt_slot=slot,
                      images=list(rows[start:start + n_real]) + [rows[start]] * pad)
        out["seconds"] += res.seconds
        out["compile_seconds"] += res.compile_seconds
        for r in range(n_real):
            row = res.row(r)
            text = decode_answer(model.tokenizer, row.tokens)
            out["output"].append(text)
            out["correct"].append(S.score(insts[start + r], text))
            out["nfe"].append(int(res.nfe[r]))
            out["non_eos"].append(gen.completion(row).non_eos_tokens)
    return out


def run(model_dir: str = DEFAULT_MODEL, n: int = 50, batch: int = 8, repeats: int = 3,
        decoders: Sequence[str] = DECODER_NAMES, seed: int = 0, log=print) -> tuple[list[dict], dict]:
    """Decodes the held-out job with every decoder; returns (rows, run info). A row per decoder and task, and
    one with ``task="all"`` (accuracy over all instances, TPF and tokens/s of the whole job)."""
    from polestar_jax.api import load

    unknown = [x for x in decoders if x not in DECODER_NAMES]
    if unknown:
        raise PolestarError(f"unknown decoder(s) {', '.join(unknown)} (choose from {', '.join(DECODER_NAMES)})")
    if n <= 0 or batch <= 0 or repeats <= 0:
        raise PolestarError("--n, --batch and --repeats must be positive")
    load_before = _machine()["loadavg"]
    model = load(model_dir, compile_cache=False)
    if not model.takes_images:
        raise PolestarError(f"{model_dir} is not a LLaDA-V folder")
    insts = instances(n)
    t0 = time.perf_counter()
    ids, rows = model.image_prompts([i.question for i in insts], [S.draw(i.scene) for i in insts])
    encode_s = time.perf_counter() - t0
    slot = model.engine.prompt_slot([len(p) for p in ids])
    results: list[dict] = []
    for name in decoders:
        d = next(x for x in DECODERS if x.name == name)
        first = _decode(model, d, ids, rows, insts, batch, slot, seed)  # compiles
        runs = [first] + [_decode(model, d, ids, rows, insts, batch, slot, seed) for _ in range(repeats)]
        for a in runs[1:]:
            assert a["output"] == first["output"] and a["nfe"] == first["nfe"], f"{name}: a repeat decoded otherwise"
        secs = [r["seconds"] for r in runs[1:]]
        for task in ("all", *S.TASK_NAMES):
            k = [i for i, inst in enumerate(insts) if task == "all" or inst.task == task]
            tok, nfe = sum(first["non_eos"][i] for i in k), sum(first["nfe"][i] for i in k)
            row = {"decoder": name, "task": task, "n": len(k),
                   "accuracy": float(np.mean([first["correct"][i] for i in k])),
                   "tpf": tok / nfe if nfe else 0.0, "nfe": nfe / len(k)}
            if task == "all":
                med = statistics.median(secs)
                row.update(tps=tok / med if med > 0 else 0.0, seconds=med, seconds_runs=secs,
                           compile_seconds=first["compile_seconds"], doc=d.doc,
                           examples=[{"question": insts[i].question, "answer": insts[i].answer,
                                      "output": first["output"][i]} for i in range(0, len(insts), n)])
            results.append(row)
        a = results[-1 - len(S.TASK_NAMES)]
        log(f"{name:16s} acc {a['accuracy']:.3f} tpf {a['tpf']:.2f} tps {a['tps']:.1f} nfe {a['nfe']:.1f} "
            f"({a['seconds']:.2f}s/job, compile {a['compile_seconds']:.1f}s)")
    info = {"model": os.path.relpath(model_dir) if os.path.isabs(model_dir) else model_dir,
            "n_per_task": n, "batch": batch, "repeats": repeats, "seed": seed, "prompt_slot": slot,
            "gen_length": model.decode_config().gen_length, "block_length": model.decode_config().block_length,
            "image_rows": int(rows[0].shape[0]), "encode_seconds": round(encode_s, 2),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": dict(_machine(), loadavg_before=load_before, uptime=_uptime())}
    return results, info


def markdown(results: list[dict], info: dict, command: str) -> str:
    """results.md: the run's settings and a table per decoder (all tasks) and per task (accuracy)."""
    m = info["machine"]
    lines = [f"# LLaDA-V decoders on `tiny_vision` ({info['date']})", "",
             f"Command: `{command}`", "",
             f"{info['n_per_task']} held-out pictures per task ({len(S.TASK_NAMES)} tasks), batch {info['batch']}, "
             f"prompt slot {info['prompt_slot']} ({info['image_rows']} image rows), gen length "
             f"{info['gen_length']}, block {info['block_length']}; tokens/s: median of {info['repeats']} decodes "
             f"of the whole job, compile excluded. Machine: {m.get('cpu_count')} CPUs ({m.get('backend')}), "
             f"load average {m.get('loadavg_before')} before, {m.get('loadavg')} after.", "",
             "| decoder | accuracy | TPF | tokens/s | NFE / instance |", "|---|---|---|---|---|"]
    for r in results:
        if r["task"] == "all":
            lines.append(f"| {r['decoder']} | {100 * r['accuracy']:.1f}% | {r['tpf']:.2f} | {r['tps']:.1f} | "
                         f"{r['nfe']:.1f} |")
    names = [r["decoder"] for r in results if r["task"] == "all"]
    lines += ["", "Accuracy per task:", "", "| task | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for t in S.TASK_NAMES:
        acc = {r["decoder"]: r["accuracy"] for r in results if r["task"] == t}
        lines.append(f"| {t} | " + " | ".join(f"{100 * acc[x]:.0f}%" for x in names) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (module docstring): 0 when done, 2 with one ``error:`` line for bad input."""
    return cli.report_errors(_main, argv)


def _main(argv: Optional[Sequence[str]]) -> None:
    ap = cli.Parser(prog="python -m bench.bench_vision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a trained LLaDA-V folder (default: tiny_vision)")
    ap.add_argument("--n", type=int, default=50, help="held-out pictures per task (default 50)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decoders", default=",".join(DECODER_NAMES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join("bench", "results", "vision"))
    args = ap.parse_args(argv)
    command = "python -m bench.bench_vision " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    results, info = run(args.model, args.n, args.batch, args.repeats,
                        [x.strip() for x in args.decoders.split(",") if x.strip()], args.seed)
    info["command"] = command
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"run": info, "results": results}, f, indent=1)
        f.write("\n")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown(results, info, command))
    print(f"wrote {args.out}/results.json and results.md")


if __name__ == "__main__":
    sys.exit(main())
