"""Commit probe (issue #13): how did a decoder commit the tokens it got wrong?

Decodes the first ``--n`` evaluation instances of each ``--tasks`` task with each ``--decoders`` decoder
(:mod:`bench.run`'s names: ``fastdllm-dual-checked``, ``polestar-commit-only``, ``polestar``, ...) at the
model folder's generation and block length, and sorts every answer token by how it was committed:

* ``early``: Polestar-Commit's early commit (a rise of the token's drift at middling confidence; the
  ``commit_early`` mask of :class:`polestar_jax.decode.polestar.policy.StepOut`, which excludes tokens that also passed the
  threshold);
* ``suffix``: committed while an earlier block was being decoded (Polestar's suffix commits: the token's
  commit forward comes before its own block's first forward);
* ``rule``: every other token (the threshold / top-1 rule of the block being decoded, block starts included).

Only the positions that decide the answer are counted: the reference answer and the EOS after it (what
follows a correct EOS is cut off by :func:`bench.tasks.decode_answer`). A token there is *wrong* where it
differs from the reference token. Per decoder and task the probe reports exact-match accuracy, and per kind
the tokens per answer and the share of them that are wrong; and for each wrong answer the kind of its first
wrong token in commit order (the wrong token with the smallest commit forward; on a tie, the leftmost),
i.e. the commit that broke the answer first.

Usage::

    python -m bench.probe_commits --model polestar_jax/assets/tiny_long --tasks long_sort,long_runmax \\
        --decoders fastdllm-dual-checked,polestar-commit-only,polestar --n 50
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import tasks as T  # noqa: E402
from bench import train_tiny as TT  # noqa: E402
from bench.common import decode_batches, load_bench_model, prompt_slot  # noqa: E402
from bench.run import decode_config, expand_tasks, resolve_decoders  # noqa: E402
from polestar_jax import cli  # noqa: E402
from polestar_jax.errors import PolestarError  # noqa: E402

#: Commit kinds, in the order they are reported.
KINDS = ("rule", "early", "suffix")


def commit_kinds(commit_step: np.ndarray, block_nfe: np.ndarray, early: Optional[np.ndarray],
                 block_length: int) -> np.ndarray:
    """The kind index (into :data:`KINDS`) of every generated position of one row.

    commit_step [G] int: the row's forward that committed each position; block_nfe [n_blocks] int: the row's
    forwards per block; early [G] bool or None: positions committed by Polestar's early rule."""
    G = commit_step.shape[0]
    first = np.concatenate([[0], np.cumsum(block_nfe)[:-1]])  # each block's first forward
    own_first = first[np.arange(G) // block_length]
    kind = np.where((commit_step >= 0) & (commit_step < own_first), KINDS.index("suffix"), KINDS.index("rule"))
    if early is not None:
        kind = np.where(early, KINDS.index("early"), kind)
    return kind


def early_mask(steps: Sequence, row: int, gen_length: int, block_length: int) -> np.ndarray:
    """[G] bool: the positions of ``row`` that a Polestar step committed early (``steps``: the per-block
    StepOut buffers of a :class:`polestar_jax.engine.engine.GenerateResult`)."""
    out = np.zeros(gen_length, bool)
    for blk, st in enumerate(steps):
        out[blk * block_length:(blk + 1) * block_length] = np.asarray(st.commit_early)[:, row].any(axis=0)
    return out


def probe(model: str, tasks: Sequence[str], decoders: Sequence[str], n: int, batch: int = 72,
          slot: Optional[int] = None, seed: int = 0) -> dict[str, dict[str, dict]]:
    """``{decoder: {task: stats}}`` over the first ``n`` evaluation instances of each task; stats:
    ``accuracy``, ``answers``, and per kind ``tokens`` (per answer, over the answer and its EOS) and
    ``wrong`` (share of that kind's tokens that are wrong; None without tokens), and ``first_wrong``
    ({kind: wrong answers whose first wrong token, in commit order, is of that kind})."""
    unknown = sorted(set(tasks) - set(T.TASKS))
    if unknown:
        raise PolestarError(f"unknown task(s) {', '.join(unknown)}")
    bm = load_bench_model(model)
    tok, G, B = bm.tok, bm.gen_length, bm.block_length
    items = [(task, p, a) for task in tasks for p, a in T.eval_instances(task, n)]
    prompts = [tok.chat_prompt_ids(p) for _, p, _ in items]
    slot = prompt_slot(prompts) if slot is None else slot
    refs = np.stack([TT.answer_ids(tok, a, G) for _, _, a in items])  # [items, G]
    span = [min(len(a.encode("utf-8")) + 1, G) for _, _, a in items]  # the answer and its EOS
    out: dict[str, dict[str, dict]] = {}
    for d in resolve_decoders(decoders, ()):
        dcfg = decode_config(d, G, B)
        acc: dict[str, dict] = {t: {"answers": 0, "correct": 0, "count": np.zeros(len(KINDS), int),
                                    "bad": np.zeros(len(KINDS), int), "first": np.zeros(len(KINDS), int)}
                                for t in tasks}
        for start, n_real, res in decode_batches(bm.engine, prompts, dcfg, min(batch, len(items)), slot,
                                                 seed):
            for r in range(n_real):
                task, prompt, _ = items[start + r]
                toks = np.asarray(res.tokens[r])
                early = early_mask(res.steps, r, G, B) if res.steps is not None else None
                m = span[start + r]
                kind = commit_kinds(np.asarray(res.commit_step[r]), np.asarray(res.block_nfe[r]), early, B)[:m]
                wrong = toks[:m] != refs[start + r, :m]
                ok = bool(T.score(task, prompt, T.decode_answer(tok, toks)))
                a = acc[task]
                a["answers"] += 1
                a["correct"] += ok
                a["count"] += np.bincount(kind, minlength=len(KINDS))
                a["bad"] += np.bincount(kind[wrong], minlength=len(KINDS))
                if not ok and wrong.any():
                    cs = np.where(wrong, np.asarray(res.commit_step[r])[:m], np.iinfo(np.int32).max)
                    a["first"][kind[int(np.argmin(cs))]] += 1
        out[d.name] = {t: {"accuracy": a["correct"] / a["answers"], "answers": a["answers"],
                           **{k: {"tokens": a["count"][i] / a["answers"],
                                  "wrong": (a["bad"][i] / a["count"][i]) if a["count"][i] else None}
                              for i, k in enumerate(KINDS)},
                           "first_wrong": {k: int(a["first"][i]) for i, k in enumerate(KINDS)}}
                       for t, a in acc.items()}
    return out


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(result: dict[str, dict[str, dict]]) -> str:
    """The probe's result as one markdown table (a row per decoder and task)."""
    head = ("| decoder | task | exact match | " + " | ".join(f"{k} tokens / answer (wrong)" for k in KINDS)
            + " | first wrong token: " + " / ".join(KINDS) + " |")
    lines = [head, "|" + "---|" * (3 + len(KINDS) + 1)]
    for name, per_task in result.items():
        for task, s in per_task.items():
            cells = [f"{s[k]['tokens']:.2f} ({_pct(s[k]['wrong'])})" for k in KINDS]
            lines.append(f"| {name} | {task} | {100 * s['accuracy']:.1f}% | " + " | ".join(cells) + " | "
                         + " / ".join(str(s["first_wrong"][k]) for k in KINDS) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = cli.Parser(prog="python -m bench.probe_commits", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="polestar_jax/assets/tiny_long", help="trained model folder")
    ap.add_argument("--tasks", default="long_sort,long_runmax", help="comma-separated tasks or groups")
    ap.add_argument("--decoders", default="fastdllm-dual-checked,polestar-commit-only,polestar",
                    help="comma-separated bench.run decoder names")
    ap.add_argument("--n", type=int, default=50, help="evaluation instances per task")
    ap.add_argument("--batch", type=int, default=72, help="rows per decode batch")
    ap.add_argument("--slot", type=int, default=None,
                    help="prompt slot (default: the longest prompt of this job; bench.run's published tiny_long "
                         "run used 144)")
    args = ap.parse_args(argv)
    if args.n <= 0 or args.batch <= 0:
        ap.error("--n and --batch must be positive")

    def run(_argv) -> int:
        res = probe(args.model, expand_tasks(args.tasks), args.decoders.split(","), args.n, args.batch, args.slot)
        print(markdown(res))
        return 0

    return cli.run_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
