"""``python -m polestar_jax.eval``: lm-evaluation-harness tasks with the polestar-jax engine.

A thin command line over lm-eval's evaluator and the ``polestar-jax`` model
(:mod:`polestar_jax.lm_eval_model`; needs ``pip install -e '.[eval]'``)::

    python -m polestar_jax.eval [--model DIR] --tasks gsm8k [--preset paper-256] --output-path OUT
        [--limit N] [--include-path DIR] [--apply-chat-template] [--decoder ...] [--seed S] [--json]

Without ``--model`` it evaluates the bundled ``tiny_tasks`` model. Without ``--preset`` the decoder and block
length are those ``python -m polestar_jax.generate`` would use (the model folder's generation defaults, the
Polestar defaults) and each request's gen length follows its task's ``max_gen_toks`` (rounded up to a
multiple of the block length); the decoder flags (``--decoder``, ``--gen-length``, ``--threshold``,
``--top-k``, ...) and ``--model-args k=v,...`` override it. A preset (:data:`PRESETS`) is the official
Polestar evaluation protocol of the paper's Table 1 (gt-synergy-lab/Polestar ``configs/evaluation/text.json``
and ``evaluation/run.py``): the task's few-shot count, gen length 256 or 512 whatever the task asks, block 32,
threshold 0.9, early threshold 0.7, batch 1, seed 42, the whole few-shot prompt as one chat-templated user
turn, and HumanEval's responses not cut at its stop strings.

Request i of a task (lm-eval's document order) draws its randomness from (seed, i), exactly as the i-th
prompt of ``generate --prompts-file``; ``--seed`` also seeds lm-eval (few-shot sampling). Writes
``OUT/results.json`` (lm-eval's results, plus ``polestar_jax``: per task and in total ``tpf``, ``tps``,
``nfe``, ``non_eos_tokens``, ``decode_seconds``, ``compile_seconds``, ..., the decoder config, jax version and
device) and ``OUT/samples_<task>.jsonl`` (lm-eval's per-sample records, each with its requests' accounting
under ``polestar_jax``); an existing ``OUT/results.json`` is never overwritten. Tasks that execute generated
code (HumanEval, MBPP) run only with ``--allow-code-execution``. Bad input is one ``error:`` line and exit
status 2; Ctrl-C ends the run with ``interrupted`` and status 130.

Several processes or hosts (``--coordinator HOST:PORT --num-processes N --process-id I``, or the
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` environment, as ``generate``) evaluate
together over one ``--mesh`` spanning all their devices: every process runs every request, process 0 alone
writes the files and prints, and all exit with the same status.
"""
from __future__ import annotations

if __name__ == "__main__":  # first of all: Ctrl-C from here on ends cleanly (polestar_jax.cli takes over)
    import os as _os
    import signal as _signal

    _signal.signal(_signal.SIGINT, lambda *_: (_os.write(2, b"interrupted\n"), _os._exit(130)))

import argparse
import dataclasses
import datetime
import json
import logging
import os
import sys
import time
from typing import Any, Optional, Sequence

from polestar_jax import cli
from polestar_jax.config import DecodeConfig, PolestarConfig
from polestar_jax.errors import PolestarError

__all__ = ["Preset", "PRESETS", "PAPER_TASKS", "build_parser", "model_args_from", "run", "main"]

#: The paper's text benchmarks and their few-shot counts (Polestar's configs/evaluation/text.json).
PAPER_TASKS = {"gsm8k": 5, "minerva_math": 4, "humaneval": 0, "mbpp": 3}
#: Tasks that execute generated programs.
CODE_TASKS = ("humaneval", "mbpp")


@dataclasses.dataclass(frozen=True)
class Preset:
    """An evaluation protocol: model_args, per-task few-shot counts and prompt formatting."""

    name: str
    model_args: dict
    num_fewshot: dict
    doc: str
    apply_chat_template: bool = True
    fewshot_as_multiturn: bool = False
    seed: int = 42
    #: tasks whose responses are returned whole (the official harness does not cut an instruct model's
    #: HumanEval response at the task's stop strings; its postprocessor extracts the code)
    no_until: tuple = ("humaneval",)


def _paper(gen: int) -> Preset:
    return Preset(
        name=f"paper-{gen}",
        model_args={"decoder": "polestar", "cache": "dual", "gen_length": gen, "block_length": 32,
                    "threshold": 0.9, "early_threshold": 0.7, "batch_size": 1},  # steps: gen length (default)
        num_fewshot=dict(PAPER_TASKS),
        doc=f"the paper's Table 1 protocol at gen length {gen}: Polestar (dual cache, threshold 0.9, early "
            f"threshold 0.7), block 32, batch 1, seed 42; GSM8K 5-shot, MATH (minerva_math) 4-shot, HumanEval "
            f"0-shot, MBPP 3-shot; chat template on the whole prompt as one user turn")


PRESETS: dict[str, Preset] = {p.name: p for p in (_paper(256), _paper(512))}


def build_parser() -> argparse.ArgumentParser:
    ap = cli.Parser(prog="python -m polestar_jax.eval",
                    description="Evaluate lm-evaluation-harness tasks with the polestar-jax engine "
                                "(lm-eval model 'polestar-jax').")
    ap.add_argument("--model", help="model folder (HF or converted; default: the bundled tiny_tasks model)")
    ap.add_argument("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="; ".join(f"{p.name}: {p.doc}" for p in PRESETS.values()))
    ap.add_argument("--output-path", required=True,
                    help="folder for results.json and samples_<task>.jsonl (an existing results.json is never "
                         "overwritten)")
    ap.add_argument("--limit", type=float, default=None, help="evaluate the first N documents of each task "
                                                              "(a smoke run; < 1: a fraction)")
    ap.add_argument("--include-path", action="append", default=[],
                    help="extra folder of lm-eval task YAMLs (repeatable)")
    ap.add_argument("--apply-chat-template", action=argparse.BooleanOptionalAction, default=None,
                    help="render prompts with the model's chat template (default: on with a preset, else off)")
    ap.add_argument("--fewshot-as-multiturn", action=argparse.BooleanOptionalAction, default=None,
                    help="with the chat template, few-shot examples as separate turns (default: off: the whole "
                         "prompt is one user turn, as the official harness)")
    ap.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the preset's, "
                                                                  "else the task's)")
    ap.add_argument("--batch-size", type=int, default=None, help="rows per decode batch (default: the preset's, "
                                                                 "else 1)")
    ap.add_argument("--seed", type=int, default=None,
                    help="job seed: request i of a task draws from (seed, i); also lm-eval's seeds "
                         "(default: the preset's 42, else 0)")
    ap.add_argument("--model-args", default="", help="more polestar-jax model_args, k=v,... (see "
                                                      "polestar_jax.lm_eval_model)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="cast weights (default: as stored)")
    ap.add_argument("--weights", default=None, choices=["float", "int8"],
                    help="int8: matmul weights stored as int8 with a scale per output channel (default: float)")
    ap.add_argument("--mesh", default=None, help="shard over a device mesh, e.g. data=2,model=4 (with several "
                                                 "processes: over all their devices)")
    cli.add_distributed_flags(ap)
    ap.add_argument("--allow-code-execution", action="store_true",
                    help="allow tasks that execute generated code (HumanEval, MBPP)")
    ap.add_argument("--bootstrap-iters", type=int, default=100000,
                    help="bootstrap iterations for lm-eval's standard errors (0: none)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--verbose", action="store_true", help="show lm-eval's log messages")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    d = ap.add_argument_group("decoding (DecodeConfig; default: the preset's, else as python -m polestar_jax.generate, "
                              "the gen length from each task's max_gen_toks)")
    cli.add_config_flags(d, DecodeConfig)
    g = ap.add_argument_group("Polestar knobs (PolestarConfig, decoders polestar and polestar_v)")
    cli.add_config_flags(g, PolestarConfig)
    return ap


def model_args_from(args, preset: Optional[Preset]) -> dict[str, Any]:
    """The polestar-jax model_args of the command line: the preset's, then ``--model-args``, then the flags."""
    from lm_eval.utils import simple_parse_args_string

    out: dict[str, Any] = dict(preset.model_args) if preset else {}
    try:
        extra = simple_parse_args_string(args.model_args)
    except (ValueError, IndexError) as e:
        raise PolestarError(f"--model-args {args.model_args!r} is not k=v,...: {e}") from None
    out.update(extra)
    given = cli.given_config_values(args, DecodeConfig)
    given.update(cli.given_config_values(args, PolestarConfig))
    if "decoder" in given and preset is not None and given["decoder"] != "polestar":
        # another decoder under a preset keeps its lengths and threshold, drops Polestar's knob
        for k in PolestarConfig.__dataclass_fields__:
            out.pop(k, None)
        out.pop("cache", None)
        if given["decoder"] == "llada":
            out.pop("threshold", None)
    out.update(given)
    if args.model is not None:
        out["model"] = args.model
    for key, value in (("batch_size", args.batch_size), ("dtype", args.dtype), ("weights", args.weights),
                       ("mesh", args.mesh)):
        if value is not None:
            out[key] = value.replace(",", ";") if key == "mesh" else value
    seed = args.seed if args.seed is not None else out.get("seed", preset.seed if preset else 0)
    out["seed"] = seed
    if args.no_progress:
        out["progress"] = False
    return out


def _results_path(out_dir: str) -> str:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise PolestarError(f"--output-path {out_dir} is a file, not a folder")
    path = os.path.join(out_dir, "results.json")
    if os.path.exists(path):
        raise PolestarError(f"{path} already exists; choose a new --output-path")
    return path


def _merge(into: dict, res: dict) -> dict:
    if not into:
        return res
    for k, v in res.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            into[k].update(v)
        elif k not in into:
            into[k] = v
    return into


def _device() -> dict:
    import jax

    devs = jax.devices()
    return {"platform": devs[0].platform, "device_kind": getattr(devs[0], "device_kind", ""), "count": len(devs),
            "process_count": jax.process_count()}


def _quiet_lm_eval(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.WARNING
    for name in ("lm-eval", "lm_eval", "lm_eval.evaluator", "lm_eval.tasks", "lm_eval.api"):
        logging.getLogger(name).setLevel(level)


def _tasks_and_preset(args) -> tuple[list[str], Optional[Preset]]:
    """The command line's task names and preset, checked (one-line errors for bad input)."""
    if args.model is not None:
        cli.need_folder(args.model)
    for p in args.include_path:
        cli.need_folder(p, "--include-path folder")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise PolestarError("--tasks names no task")
    if args.limit is not None and args.limit <= 0:
        raise PolestarError(f"--limit must be positive, got {args.limit:g}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise PolestarError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise PolestarError("lm-eval is not installed: pip install -e '.[eval]'") from None
    code = [t for t in tasks if any(t == c or t.startswith(c + "_") for c in CODE_TASKS)]
    if code and not args.allow_code_execution:
        raise PolestarError(f"{', '.join(code)} executes generated code: pass --allow-code-execution")
    return tasks, (PRESETS[args.preset] if args.preset else None)


def _task_manager(include_path: Sequence[str], tasks: Sequence[str]):
    """lm-eval's TaskManager for ``tasks``: the include paths' YAMLs alone when they hold every task (no
    indexing of lm-eval's thousands), else all of them; a one-line error for an unknown task."""
    from lm_eval.tasks import TaskManager

    tm = None
    if include_path:
        tm = TaskManager(include_path=list(include_path), include_defaults=False)
        if not all(tm.match_tasks([t]) for t in tasks):
            tm = None
    tm = tm or TaskManager(include_path=list(include_path) or None)
    unknown = [t for t in tasks if not tm.match_tasks([t])]
    if unknown:
        raise PolestarError(f"unknown task(s) {', '.join(unknown)} (see lm-eval's task list; local tasks need "
                            "--include-path)")
    return tm


def _evaluate(lm, tasks: Sequence[str], tm, args, preset: Optional[Preset], chat: bool, multiturn: bool,
              seed: int) -> tuple[dict, dict]:
    """lm-eval's ``simple_evaluate`` task by task with ``lm``; returns the merged results and, per group
    task (minerva_math), the accounting of its subtasks' requests together."""
    from lm_eval import evaluator

    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    results: dict = {}
    groups: dict[str, dict] = {}
    for task in tasks:
        first = len(lm.records)
        shots = args.num_fewshot if args.num_fewshot is not None else (preset.num_fewshot.get(task) if preset
                                                                       else None)
        lm.apply_until = lm.own["apply_until"] and not (preset and task in preset.no_until)
        try:
            res = evaluator.simple_evaluate(
                model=lm, tasks=[task], num_fewshot=shots, limit=limit, log_samples=True, task_manager=tm,
                apply_chat_template=chat, fewshot_as_multiturn=multiturn, bootstrap_iters=args.bootstrap_iters,
                random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                confirm_run_unsafe_code=args.allow_code_execution)
        except ValueError as e:
            if isinstance(e, PolestarError):
                raise
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "unsafe" in msg:
                raise PolestarError(f"{task} executes generated code: pass --allow-code-execution") from None
            raise PolestarError(f"{task}: {msg}") from None
        results = _merge(results, res)
        subtasks = {r["task"] for r in lm.records[first:]}
        if subtasks and subtasks != {task}:  # a group (minerva_math): its subtasks' requests together
            groups[task] = lm.summary(lm.records[first:])
    return results, groups


def _run_record(args, argv, lm, acct: dict, chat: bool, multiturn: bool, seed: int, total_s: float) -> dict:
    """results.json's ``polestar_jax`` record: the accounting and what defines the run."""
    import jax

    return {
        **acct,
        "preset": args.preset, "seed": seed, "limit": args.limit, "num_fewshot": args.num_fewshot,
        "apply_chat_template": chat, "fewshot_as_multiturn": multiturn,
        "decoder": dataclasses.asdict(lm.decode_config(lm.fixed_gen_length)),
        "gen_length": lm.fixed_gen_length if lm.fixed_gen_length is not None else "max_gen_toks rounded up to a "
                                                                                  "multiple of the block length",
        "model": lm.model.path, "batch_size": lm.batch_size, "jax_version": jax.__version__, "device": _device(),
        "command": "python -m polestar_jax.eval " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "total_seconds": total_s,
    }


def _write_outputs(out_dir: str, results: dict, samples: dict, lm) -> str:
    """Writes ``samples_<task>.jsonl`` (each sample with its requests' accounting) and ``results.json``;
    returns the latter's path."""
    from lm_eval.utils import handle_non_serializable

    os.makedirs(out_dir, exist_ok=True)
    results_path = _results_path(out_dir)  # again: another run may have finished meanwhile
    for task, rows in samples.items():
        lines = []
        for s in rows:
            s = dict(s, polestar_jax=lm.request_records(task, s.get("doc_id")))
            lines.append(json.dumps(s, default=handle_non_serializable, ensure_ascii=False))
        cli.atomic_write(os.path.join(out_dir, f"samples_{task}.jsonl"), "\n".join(lines) + ("\n" if lines else ""))
    cli.atomic_write(results_path, json.dumps(results, indent=2, default=handle_non_serializable,
                                              ensure_ascii=False) + "\n")
    return results_path


def run(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    out_dir = args.output_path
    _results_path(out_dir)
    tasks, preset = _tasks_and_preset(args)
    _quiet_lm_eval(args.verbose)
    model_args = model_args_from(args, preset)

    from lm_eval.utils import handle_non_serializable

    from polestar_jax import sharding
    from polestar_jax.engine.compile_cache import enable_compile_cache
    from polestar_jax.lm_eval_model import MODEL_NAME, PolestarLM

    enable_compile_cache()  # the command line's cache folder ($POLESTAR_JAX_CACHE) before load() keeps it

    # several processes: every one evaluates every request (SPMD over one mesh); process 0 writes and prints
    multi = cli.join_from_args(args)  # before anything uses a device
    leader = sharding.is_leader()
    if multi and not model_args.get("mesh") and leader:
        print("warning: several processes but no --mesh: every process evaluates on its own first device",
              file=sys.stderr)
    lm = PolestarLM(**(model_args if leader else dict(model_args, progress=False)))  # args checked, then loaded
    tm = _task_manager(args.include_path, tasks)
    if args.allow_code_execution:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"
    chat = args.apply_chat_template if args.apply_chat_template is not None else bool(preset and
                                                                                      preset.apply_chat_template)
    multiturn = bool(args.fewshot_as_multiturn) if args.fewshot_as_multiturn is not None else bool(
        preset and preset.fewshot_as_multiturn)
    seed = model_args["seed"]
    t0 = time.perf_counter()
    results, groups = _evaluate(lm, tasks, tm, args, preset, chat, multiturn, seed)
    total_s = time.perf_counter() - t0
    samples = results.pop("samples", {})
    results.setdefault("config", {}).update(model=MODEL_NAME, model_args=model_args, batch_size=lm.batch_size)
    acct = lm.accounting()
    acct["tasks"].update(groups)
    results["polestar_jax"] = _run_record(args, argv, lm, acct, chat, multiturn, seed, total_s)
    if not leader:
        return 0
    results_path = _write_outputs(out_dir, results, samples, lm)
    _print_summary(results, acct)
    print(f"wrote {results_path}")
    if args.json:
        cli.print_json(json.loads(json.dumps({"results": results.get("results", {}), "polestar_jax": acct,
                                              "output_path": out_dir}, default=handle_non_serializable)))
    return 0


def _print_summary(results: dict, acct: dict) -> None:
    for task, metrics in sorted(results.get("results", {}).items()):
        shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool) and "stderr" not in k)
        a = acct["tasks"].get(task)
        extra = (f" | tpf={a['tpf']:.2f} tps={a['tps']:.1f} nfe/request={a['nfe_per_request']:.1f}"
                 if a else "")
        print(f"{task}: {shown}{extra}")
    t = acct["total"]
    print(f"total: requests={t['requests']} nfe={t['nfe']} tokens={t['non_eos_tokens']} tpf={t['tpf']:.2f} "
          f"tps={t['tps']:.1f} decode={t['decode_seconds']:.2f}s compile={t['compile_seconds']:.2f}s")


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli.run_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
