"""The accuracy-throughput benchmark (issues #6, #12): every decoder on the same held-out task instances.

Runs, in ONE process and on the same instances of :mod:`bench.tasks` (held-out evaluation seeds), each
decoder of :data:`DECODERS` -- the baselines, Polestar and its ablations -- and a threshold sweep of the two
decoders the frontier compares (:data:`SWEPT`: the checked dual cache and Polestar, thresholds
:data:`SWEEP_THRESHOLDS`; the sweep rows are named ``<decoder>@<threshold>``, the unsuffixed rows are the 0.9
defaults) on a trained model (default: the bundled ``tiny_tasks`` model), and reports, per decoder and task:

* ``accuracy``: exact match (the task's scorer on the answer cut at the first end-of-text token);
* ``tpf``: tokens per forward as the paper counts them: non-EOS generated tokens / forwards;
* ``tps``: non-EOS generated tokens per second of the decode loop (compile excluded; instances decode in
  batches of ``--batch``, the same for every decoder, so rows of one run compare); the unsuffixed rows
  report the median of ``--repeats`` decodes of the whole job (default 3), the sweep points one;
* ``nfe``: forwards per instance (mean), and the mix of forward kinds behind it (``forwards_full``,
  ``forwards_windowed``, ``forwards_step``, ``forwards_refresh``; ``refresh_rows_computed``: window rows a
  refresh step computes per layer at batch 1);
* ``tps_h200_projection``: a MODEL, not a measurement: tokens/s of one H200 decoding at LLaDA-8B shapes
  (bf16, batch 1, this run's layout: prompt slot + gen length, block length) the forwards this decoder ran
  here, each at its roofline cost ``max(bytes / 4.8 TB/s, FLOPs / 989 TFLOP/s)`` from the byte and FLOP
  models of :mod:`bench.gpu_check` (:func:`h200_projection`);
* ``gflops_per_token``: FLOPs per generated position of this model, from XLA's cost analysis of one forward
  of each kind (see :func:`bench.bench_decoders.bench_forwards`) weighted by how often each decoder ran each
  kind;
* ``refresh_rate`` (Polestar): refresh steps / decode steps (forwards after the block-start passes), and
  early / suffix commits per instance.

Instance i of the job (the i-th of the task-major item list) decodes as row i of the job whatever the batch:
its random draws come from ``(seed, i)`` (``generate(..., rows=...)``), so the outputs do not depend on
``--batch``.

Usage::

    python -m bench.run [--quick] [--out DIR] [--model DIR] [--n N] [--batch B] [--decoders a,b,...]
                        [--sweep 0.7,0.8,0.9,0.95 | --no-sweep] [--variant 'FLAGS' ...] [--repeats R]
                        [--mesh data=D,model=M]
                        [--coordinator HOST:PORT --num-processes N --process-id I]

``--variant '--top-k 8 --suffix-blocks 2'`` (repeatable; any of ``generate``'s Polestar flags) adds a
diagnostic row, ``polestar[top_k=8,suffix_blocks=2]``: Polestar at 0.9 with those knobs changed, decoded
once -- to see which knob (refresh budget, trigger, window) limits Polestar on a model.

``--mesh`` decodes over a device mesh; several processes or hosts (the flags, or the
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` environment, as ``generate``) join one
runtime first and decode the same job over one mesh of all their devices; process 0 alone writes and prints.

Writes ``DIR/results.json`` (a list of rows with ``decoder``, ``task`` -- ``"all"`` for the mean over tasks
--, ``accuracy``, ``tpf``, ``tps``, ``nfe`` and more), ``DIR/run.json`` (configuration, command, machine and
its load average before and after), ``DIR/results.md`` (tables, the frontier read-off) and
``DIR/frontier.png`` (accuracy against tokens/s, measured and projected: one curve per swept decoder, a
point for every other; needs matplotlib from the ``bench`` extra, skipped with a note otherwise).
``--quick`` (8 instances per task, FLOPs from the matmul formula, one repeat) is a smoke run of a few
minutes; the full run uses 100 instances per task. Timings are wall-clock on whatever machine runs this:
compare rows of one run, and run it with nothing else running (run.json records the load).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import shlex
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np

from bench import tasks as T
from bench.bench_decoders import _fmt, forwards_gflops
from bench.common import RESULTS_DIR, decode_batches, load_bench_model, prompt_slot
from polestar_jax import cli, sharding
from polestar_jax.config import DecodeConfig, ModelConfig, PolestarConfig
from polestar_jax.errors import PolestarError
from polestar_jax.io.tokenizer import Tokenizer

__all__ = ["Decoder", "DECODERS", "SWEPT", "SWEEP_THRESHOLDS", "RunConfig", "decode_config", "sweep_decoder",
           "variant_decoder",
           "resolve_decoders", "polestar_early_threshold", "h200_projection", "frontier_readoff", "run",
           "markdown", "main"]

DEFAULT_OUT = os.path.join(RESULTS_DIR, "run")
DEFAULT_THRESHOLD = 0.9


@dataclasses.dataclass(frozen=True)
class Decoder:
    """One benchmarked decoder: a name and the :class:`DecodeConfig` fields that define it.

    ``curve``: the swept decoder this row lies on (its own name for a swept decoder's 0.9 default, the base
    name for its ``@threshold`` rows; None off the sweep); ``sweep_point``: decoded once, not ``--repeats``
    times (the ``@threshold`` rows and the ``--variant`` rows)."""

    name: str
    decoder: str
    cache: str
    threshold: Optional[float]
    polestar: Optional[dict] = None  # PolestarConfig overrides
    doc: str = ""
    step_after_full_pass: bool = True  # Fast-dLLM's reference loop (False: the checked loop)
    curve: Optional[str] = None
    sweep_point: bool = False


_REFRESH_ONLY = {"early_threshold": None, "suffix_precommit": False}
_COMMIT_ONLY = {"refresh": False, "suffix_precommit": False}

#: Every decoder of the benchmark, in report order.
DECODERS: tuple[Decoder, ...] = (
    Decoder("llada", "llada", "none", None, doc="LLaDA's sampler, one token per forward (steps = gen length)"),
    Decoder("fastdllm", "fastdllm", "none", 0.9, doc="Fast-dLLM threshold 0.9, no cache"),
    Decoder("fastdllm-prefix", "fastdllm", "prefix", 0.9, doc="Fast-dLLM threshold 0.9, prefix cache"),
    Decoder("fastdllm-dual", "fastdllm", "dual", 0.9,
            doc="Fast-dLLM threshold 0.9, dual cache, the reference loop (one more step after a full pass "
                "that filled the block): what the paper compares against"),
    Decoder("fastdllm-dual-checked", "fastdllm", "dual", 0.9, step_after_full_pass=False,
            curve="fastdllm-dual-checked",
            doc="Fast-dLLM threshold 0.9, dual cache, the checked loop (no step once the block is full, as "
                "Polestar's loop): the baseline Polestar must beat"),
    Decoder("polestar-refresh-only", "polestar", "dual", 0.9, _REFRESH_ONLY,
            doc="Polestar-Cache only: drift-guided refresh, no early commit, no suffix pre-commit"),
    Decoder("polestar-commit-only", "polestar", "dual", 0.9, _COMMIT_ONLY,
            doc="Polestar-Commit's early commit only: refresh off (the window is recomputed at block starts "
                "only), so no suffix pre-commit (it commits refreshed suffix rows); the early-commit drift "
                "comes from the block rows' own attention, which needs no refresh"),
    Decoder("polestar", "polestar", "dual", 0.9, curve="polestar",
            doc="Polestar-Cache + Polestar-Commit (default knobs)"),
    Decoder("polestar-int8", "polestar", "dual", 0.9, {"offload_hidden": "int8"},
            doc="Polestar with the refresh hidden states stored int8 (host memory where supported)"),
)
DECODER_NAMES = tuple(d.name for d in DECODERS)
#: The decoders whose threshold is swept for the frontier.
SWEPT = ("fastdllm-dual-checked", "polestar")
#: The thresholds of the sweep (0.9 is the unsuffixed default row).
SWEEP_THRESHOLDS = (0.7, 0.8, 0.9, 0.95)


def polestar_early_threshold(threshold: float) -> Optional[float]:
    """Polestar's early-commit threshold at commit threshold ``threshold`` in the sweep: the default (0.7)
    where it lies below the threshold, else ``threshold - 0.2`` (the default gap; at 0.7: 0.5), so
    Polestar-Commit stays on at every point of the curve (an early threshold must lie below the threshold)."""
    default = PolestarConfig().early_threshold
    if default is None or default < threshold:
        return default
    low = round(threshold - (DEFAULT_THRESHOLD - default), 6)
    return low if low >= 0 else None


def sweep_decoder(base: str, threshold: float) -> Decoder:
    """Decoder ``base`` (one of :data:`SWEPT`) at commit threshold ``threshold``, named
    ``f"{base}@{threshold:g}"``; the 0.9 default is the unsuffixed decoder itself."""
    d = next((x for x in DECODERS if x.name == base), None)
    if d is None or base not in SWEPT:
        raise PolestarError(f"decoder {base!r} has no threshold sweep (swept: {', '.join(SWEPT)})")
    threshold = float(threshold)
    if not 0.0 < threshold <= 1.0:
        raise PolestarError(f"sweep threshold must be in (0, 1], got {threshold:g}")
    if threshold == d.threshold:
        return d
    pol = d.polestar
    if d.decoder == "polestar":
        pol = dict(d.polestar or {}, early_threshold=polestar_early_threshold(threshold))
    return dataclasses.replace(d, name=f"{base}@{threshold:g}", threshold=threshold, polestar=pol, curve=base,
                               sweep_point=True, doc=f"{base} at threshold {threshold:g}")


class _VariantParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise PolestarError(f"--variant: {message}")


def variant_decoder(spec: str) -> Decoder:
    """The ``polestar`` decoder (threshold 0.9) with the :class:`PolestarConfig` flags of ``spec`` -- the
    flags ``python -m polestar_jax.generate`` takes, e.g. ``"--top-k 8 --suffix-blocks 2"`` -- changed: a
    diagnostic row (which knob limits Polestar on this model), decoded once, named by what it changes,
    e.g. ``polestar[top_k=8,suffix_blocks=2]``."""
    ap = _VariantParser(prog="--variant", add_help=False)
    cli.add_config_flags(ap, PolestarConfig)
    try:
        args = ap.parse_args(shlex.split(spec))
    except ValueError as e:  # unbalanced quotes
        raise PolestarError(f"--variant {spec!r}: {e}") from None
    given = cli.given_config_values(args, PolestarConfig)
    if not given:
        raise PolestarError(f"--variant {spec!r} changes no Polestar knob (give flags such as --top-k 8)")
    base = next(d for d in DECODERS if d.name == "polestar")
    pol = dict(base.polestar or {}, **given)
    PolestarConfig(**pol)  # a bad combination fails here, with the config's one-line message
    label = ",".join(f"{k}={'none' if v is None else getattr(v, 'value', v)}" for k, v in given.items())
    return dataclasses.replace(base, name=f"polestar[{label}]", polestar=pol, curve=None, sweep_point=True,
                               doc=f"polestar with {spec.strip()} (a diagnostic variant)")


def resolve_decoders(names: Sequence[str], sweep: Sequence[float], variants: Sequence[str] = ()
                     ) -> list[Decoder]:
    """The decoders of a run in report order: the named ones of :data:`DECODERS`, then for every named
    decoder of :data:`SWEPT` its ``sweep`` thresholds (ascending), then explicit ``name@threshold`` names,
    then the ``variants`` (:func:`variant_decoder`)."""
    plain = [n for n in names if "@" not in n]
    unknown = sorted(set(plain) - set(DECODER_NAMES))
    if unknown:
        raise PolestarError(f"unknown decoder(s) {', '.join(unknown)} (choose from {', '.join(DECODER_NAMES)}, "
                            f"or <{'|'.join(SWEPT)}>@<threshold>)")
    out = [d for d in DECODERS if d.name in plain]
    extra = [(b, t) for b in SWEPT if b in plain for t in sorted(set(float(x) for x in sweep))]
    for n in names:
        if "@" in n:
            base, _, t = n.partition("@")
            try:
                extra.append((base, float(t)))
            except ValueError:
                raise PolestarError(f"bad decoder name {n!r}: expected <decoder>@<threshold>") from None
    for base, t in extra:
        d = sweep_decoder(base, t)
        if all(x.name != d.name for x in out):
            out.append(d)
    for spec in variants:
        d = variant_decoder(spec)
        if any(x.name == d.name for x in out):
            raise PolestarError(f"--variant {spec!r} is given twice")
        out.append(d)
    return out


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines one benchmark run."""

    model: str = ""  # model folder ("" = bundled default)
    n: int = 100  # instances per task
    tasks: tuple[str, ...] = T.TASK_NAMES
    decoders: tuple[str, ...] = DECODER_NAMES
    sweep: tuple[float, ...] = SWEEP_THRESHOLDS  # thresholds swept for SWEPT decoders (empty: none)
    variants: tuple[str, ...] = ()  # polestar with changed knobs, e.g. "--top-k 8" (see variant_decoder)
    repeats: int = 3  # timed decodes of the whole job for the unsuffixed rows (tokens/s: the median)
    batch: int = 72
    gen_length: Optional[int] = None  # default: the model folder's generation defaults
    block_length: Optional[int] = None
    seed: int = 0
    flops: bool = True  # FLOPs from XLA's cost analysis (compiles each forward kind); False: matmul formula
    projection: bool = True  # the H200 / LLaDA-8B roofline projection column
    gpu_check: str = ""  # a bench.gpu_check JSON: its measured step times go next to the projected ones
    mesh: str = ""  # a device mesh, e.g. "data=2,model=4" ("" = one device); FLOPs then from the formula
    early_exit: bool = True  # rows stop after the first finished block holding a stop token


QUICK = RunConfig(n=8, flops=False, repeats=1)


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


def decode_config(d: Decoder, gen_length: int, block_length: int, early_exit: bool = True) -> DecodeConfig:
    """The :class:`DecodeConfig` of decoder ``d`` (steps = gen length: llada commits one token per forward;
    ``early_exit``: a row stops after the first finished block holding a stop token)."""
    pc = PolestarConfig(**(d.polestar or {}))
    return DecodeConfig(decoder=d.decoder, cache=d.cache, gen_length=gen_length, block_length=block_length,
                        steps=gen_length, threshold=d.threshold, polestar=pc,
                        step_after_full_pass=d.step_after_full_pass, early_exit=early_exit)


def _refresh_widths(dcfg: DecodeConfig) -> np.ndarray:
    """The nonzero widths a refresh's stage 3 (attention + MLP of the block and the selected window rows)
    is compiled at."""
    from polestar_jax.decode.polestar import compaction as RF

    pc = dcfg.polestar
    return np.asarray(RF.widths(pc, pc.window_rows(dcfg.block_length))[1:])


def run_decoder(engine, tok: Tokenizer, d: Decoder, items: list[tuple[str, str, str]],
                gen_length: int, block_length: int, batch: int, slot: int, seed: int,
                bar: Optional[Any] = None, early_exit: bool = True) -> dict[str, Any]:
    """Decodes every (task, prompt, answer) item with decoder ``d`` in batches of ``batch`` rows (the last
    batch padded, so one executable serves the run; item i is row i of the job: see
    :func:`bench.common.decode_batches`; over ``mesh`` when given); returns per-item outputs and counters, the
    tokens and the totals.

    Per item, the forward mix: ``full`` (full passes: every forward without a cache; one per block with
    Fast-dLLM's caches; Polestar's full block starts), ``windowed`` (Polestar's windowed block starts),
    ``step`` (cached forwards without refresh) and ``refresh_rows`` (one entry per Polestar refresh step: the
    window rows it computes per layer at batch 1, mean over layers -- the smallest compiled width that holds
    the row's own selection)."""
    dcfg = decode_config(d, gen_length, block_length, early_exit)
    keys = ("output", "correct", "nfe", "non_eos", "refresh", "steps", "early", "suffix", "full", "windowed",
            "step", "refresh_rows")
    out: dict[str, Any] = {k: [] for k in keys}
    tokens = []
    seconds = compile_s = 0.0
    prompts = [tok.chat_prompt_ids(p) for _, p, _ in items]
    widths = _refresh_widths(dcfg) if d.decoder == "polestar" else None
    for start, n_real, res in decode_batches(engine, prompts, dcfg, batch, slot, seed):
        seconds += res.seconds
        compile_s += res.compile_seconds
        tokens.append(res.tokens[:n_real])
        for r in range(n_real):
            task, prompt, _ = items[start + r]
            row = res.row(r)  # the blocks the row decoded (early exit: up to its first stop token's)
            text = T.decode_answer(tok, row.tokens)
            nfe = int(res.nfe[r])
            out["output"].append(text)
            out["correct"].append(T.score(task, prompt, text))
            out["nfe"].append(nfe)
            out["non_eos"].append(engine.completion(row).non_eos_tokens)  # (the engine's accounting)
            if res.polestar is not None:
                ps = res.polestar
                ref = int(ps["refresh_steps"][r].sum())
                starts = int(ps["processed"][r].sum())
                full, windowed = int(ps["full_pass"][r].sum()), int(ps["windowed"][r].sum())
                rows = []
                for st in res.steps:  # per block: cluster [S, b], refreshed_rows [S, b, N]
                    cl, rr = np.asarray(st.cluster), np.asarray(st.refreshed_rows)
                    for s in np.nonzero(cl[:, r])[0]:
                        rows.append(float(widths[np.searchsorted(widths, rr[s, r])].mean()))
                out["refresh"].append(ref)
                out["steps"].append(nfe - starts)
                out["early"].append(int(ps["early"][r]))
                out["suffix"].append(int(ps["suffix"][r]))
                out["full"].append(full)
                out["windowed"].append(windowed)
                out["step"].append(nfe - full - windowed - ref)
                out["refresh_rows"].append(rows)
            else:
                full = nfe if d.cache == "none" else len(row.block_nfe)  # cached: a full start per block
                out["full"].append(full)
                out["windowed"].append(0)
                out["step"].append(nfe - full)
                out["refresh_rows"].append([])
        if bar is not None:
            bar.update(n_real)
    out["tokens"] = np.concatenate(tokens)
    out["seconds"] = seconds
    out["compile_seconds"] = compile_s
    return out


# ------------------------------------------------------------------------------------ the H200 projection


@functools.lru_cache(maxsize=None)
def _projection_model(slot: int, gen_length: int, block_length: int, batch: int = 1):
    from bench import gpu_check as G

    base = ModelConfig.from_json(G.LLADA_8B_CONFIG)
    cc = G.CheckConfig(layers=base.n_layers, prompt_length=slot, gen_length=gen_length, block_length=block_length,
                       batch=batch)
    cfg, _ = G.model_config(cc)
    return G, cfg, cc


@functools.lru_cache(maxsize=4096)
def _roofline(slot: int, gen_length: int, block_length: int, kind: str, rows: Optional[float],
              batch: int = 1) -> dict:
    G, cfg, cc = _projection_model(slot, gen_length, block_length, batch)
    return G.roofline(kind, cfg, cc, rows)


#: the batch of the projection's second column (a busy server's batch)
PROJECTION_BATCH = 32


def h200_projection(decoder: str, cache: str, mix: dict, slot: int, gen_length: int, block_length: int,
                    batch: int = 1) -> dict[str, Any]:
    """Projected seconds of one H200 running a forward mix at LLaDA-8B shapes (bf16, prompt slot ``slot``,
    gen / block length as measured). A MODEL: each forward costs its roofline time
    (:func:`bench.gpu_check.roofline`: ``max(bytes_model / 4.8 TB/s, matmul FLOPs / 989 TFLOP/s)``), nothing
    for dispatch, sampling or kernels below the roofline.

    ``batch`` > 1: the instance's forwards run inside batches of that many rows packed with forwards of the
    same kind, each costing its share (1 / batch) of a batch forward: the weights are read once per batch,
    so the FLOPs count where batch 1 is bound by bytes. A refresh step computes the row's own width (a
    batch computes the width of its row with the most, and its rows wait for the slowest): an optimistic
    bound for a busy server.

    ``mix``: ``full``, ``windowed``, ``step`` (counts) and ``refresh_rows`` (one entry per refresh step: window
    rows computed per layer). Kinds: Fast-dLLM / LLaDA full passes ``full``, their cached steps ``dual_step`` /
    ``prefix_step``; Polestar's full / windowed block starts ``polestar_start`` / ``polestar_windowed_start``,
    its steps ``polestar_step`` and ``polestar_refresh_step`` at the rows each computed."""
    cost = lambda kind, rows=None: _roofline(slot, gen_length, block_length, kind, rows, batch)["seconds"] / batch
    if decoder == "polestar":
        kinds = {"full": "polestar_start", "windowed": "polestar_windowed_start", "step": "polestar_step"}
    else:
        kinds = {"full": "full", "windowed": "full", "step": f"{cache}_step" if cache != "none" else "full"}
    by = {k: mix.get(k, 0) * cost(kind) for k, kind in kinds.items()}
    by["refresh"] = sum(cost("polestar_refresh_step", w) for w in mix.get("refresh_rows", ()))
    return {"seconds": sum(by.values()), "seconds_by_kind": by}


# --------------------------------------------------------------------------------------------------- rows


def _row(d: Decoder, task: str, idx: Sequence[int], res: dict, seconds: float, flops_by: Optional[dict],
         n_blocks: int, gen_length: int, proj_s: Optional[Sequence[float]],
         proj_b: Optional[Sequence[float]] = None) -> dict[str, Any]:
    sel = lambda key: [res[key][i] for i in idx] if res[key] else []
    n = len(idx)
    nfe, non_eos = sum(sel("nfe")), sum(sel("non_eos"))
    row = {
        "decoder": d.name, "task": task, "n": n,
        "accuracy": float(np.mean(sel("correct"))),
        "tpf": non_eos / max(1, nfe),
        "tps": non_eos / seconds if seconds > 0 else 0.0,
        "nfe": nfe / n,
        "threshold": d.threshold, "curve": d.curve,
        "tpf_all_positions": gen_length * n / max(1, nfe),
        "non_eos_tokens": non_eos,
        "forwards_full": sum(sel("full")) / n,
        "forwards_windowed": sum(sel("windowed")) / n,
        "forwards_step": sum(sel("step")) / n,
    }
    rr = [w for ws in sel("refresh_rows") for w in ws]
    row["forwards_refresh"] = len(rr) / n
    starts = n * n_blocks  # Fast-dLLM's cached decoders start every block with a full pass
    if d.decoder == "polestar":
        ref, steps = sum(sel("refresh")), sum(sel("steps"))
        starts = nfe - steps  # blocks Polestar processed (a block filled ahead by suffix commits has none)
        row.update(early_threshold=PolestarConfig(**(d.polestar or {})).early_threshold,
                   refresh_rate=ref / max(1, steps), refresh_steps=ref / n,
                   refresh_rows_computed=float(np.mean(rr)) if rr else 0.0,
                   early_commits=sum(sel("early")) / n, suffix_commits=sum(sel("suffix")) / n)
    else:
        ref = 0
    if flops_by is not None:
        gflops = forwards_gflops(d.decoder, d.cache, nfe, starts, ref, flops_by)
        row["gflops_per_token"] = gflops / (n * gen_length)  # per generated position
    if proj_s is not None:
        sec = sum(proj_s[i] for i in idx)
        row["tps_h200_projection"] = non_eos / sec if sec > 0 else 0.0
        row["h200_projection_ms_per_instance"] = 1e3 * sec / n
    if proj_b is not None:
        sec = sum(proj_b[i] for i in idx)
        row[f"tps_h200_projection_b{PROJECTION_BATCH}"] = non_eos / sec if sec > 0 else 0.0
    return row


def _plan(decoders: list[Decoder], repeats: int) -> list[tuple[Decoder, int]]:
    """(decoder, repeat) in run order: every decoder once, then the repeats of the unsuffixed ones, round
    after round (so a slow patch of the machine does not land on one decoder's repeats)."""
    plan = [(d, 0) for d in decoders]
    for rep in range(1, max(1, repeats)):
        plan += [(d, rep) for d in decoders if not d.sweep_point]
    return plan


def _loadavg() -> Optional[list[float]]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


#: Task groups ``--tasks`` accepts by name: the ``tiny_tasks`` set and the long-answer set of ``tiny_long``.
TASK_GROUPS: dict[str, tuple[str, ...]] = {"tiny_tasks": T.TASK_NAMES, "long": T.LONG_TASK_NAMES}


def expand_tasks(spec: str) -> tuple[str, ...]:
    """Task names of a comma-separated ``--tasks`` value, groups (:data:`TASK_GROUPS`) expanded in place."""
    out: list[str] = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        out.extend(TASK_GROUPS.get(item, (item,)))
    return tuple(dict.fromkeys(out))


def run(rc: RunConfig, out_dir: Optional[str] = DEFAULT_OUT, command: str = "", progress: bool = True) -> dict:
    """Runs the benchmark; writes results.json / run.json / results.md / frontier.png into ``out_dir`` when
    given (in a multi-process run, which must have joined first: process 0 only)."""
    t_start = time.perf_counter()
    load_before = _loadavg()
    bad_tasks = sorted(set(rc.tasks) - set(T.TASKS))
    if bad_tasks:
        raise PolestarError(f"unknown task(s) {', '.join(bad_tasks)} (choose from {', '.join(T.TASKS)}, or the "
                            f"groups {', '.join(TASK_GROUPS)})")
    decoders = resolve_decoders(rc.decoders, rc.sweep, rc.variants)
    mesh = sharding.mesh_or_none(rc.mesh or None)  # over every process's devices once joined (see main)
    leader = sharding.is_leader()  # several processes: all decode the same job, process 0 writes
    bm = load_bench_model(rc.model, rc.gen_length, rc.block_length, mesh=mesh)
    mcfg, params, tok = bm.mcfg, bm.params, bm.tok
    gen_length, block_length = bm.gen_length, bm.block_length
    for d in decoders:  # every configuration is valid before anything runs
        decode_config(d, gen_length, block_length)
    items = [(task, p, a) for task in rc.tasks for p, a in T.eval_instances(task, rc.n)]
    slot = prompt_slot([tok.chat_prompt_ids(p) for _, p, _ in items])
    batch = min(rc.batch, len(items))
    n_blocks = gen_length // block_length
    gpu = gpu_check_table(rc.gpu_check, slot, gen_length, block_length) if rc.gpu_check else None
    _log(f"[run] model {bm.model_dir}: {mcfg.n_layers}L d{mcfg.d_model}; {len(rc.tasks)} tasks x {rc.n} instances; "
         f"gen {gen_length} block {block_length}; batch {batch}; prompt slot {slot}; {len(decoders)} decoders; "
         f"load {load_before}")
    flops_by = None
    xla_flops = rc.flops and mesh is None  # (the cost analysis is of one-device programs)
    try:
        _log("[run] FLOPs per forward kind (" + ("XLA cost analysis" if xla_flops else "matmul formula") + ")")
        flops_by = _forward_flops(params, mcfg, slot, gen_length, block_length, xla_flops)
    except Exception as e:  # noqa: BLE001 - FLOPs are a nice-to-have
        _log(f"[run] no FLOP counts: {type(e).__name__}: {e}")
    plan = _plan(decoders, rc.repeats)
    bar = _Progress(len(items) * len(plan)) if progress and leader else None
    results: dict[str, dict] = {}
    runs: dict[str, list[float]] = {d.name: [] for d in decoders}
    compile_s: dict[str, float] = {d.name: 0.0 for d in decoders}
    compiled: dict[str, int] = {d.name: 0 for d in decoders}  # executables compiled (or loaded) per decoder
    same: dict[str, bool] = {d.name: True for d in decoders}
    for d, rep in plan:
        if bar is not None:
            bar.update(0, d.name + (f" (repeat {rep + 1})" if rep else ""))
        n0 = bm.engine.compiles
        res = run_decoder(bm.engine, tok, d, items, gen_length, block_length, batch, slot, rc.seed, bar,
                          early_exit=rc.early_exit)
        runs[d.name].append(res["seconds"])
        compile_s[d.name] += res["compile_seconds"]
        compiled[d.name] += bm.engine.compiles - n0
        if rep == 0:
            results[d.name] = res
        else:
            same[d.name] &= bool(np.array_equal(res["tokens"], results[d.name]["tokens"]))
    if bar is not None:
        bar.close()
    rows, per_item = [], {}
    for d in decoders:
        res = results[d.name]
        seconds = statistics.median(runs[d.name])
        proj = proj_b = None
        if rc.projection:
            mixes = [{k: res[k][i] for k in ("full", "windowed", "step", "refresh_rows")} for i in range(len(items))]
            proj = [h200_projection(d.decoder, d.cache, m, slot, gen_length, block_length)["seconds"] for m in mixes]
            proj_b = [h200_projection(d.decoder, d.cache, m, slot, gen_length, block_length,
                                      PROJECTION_BATCH)["seconds"] for m in mixes]
        all_idx = list(range(len(items)))
        # tokens/s is a property of the whole decode loop (tasks are mixed in a batch): every row of a
        # decoder reports the decoder's overall tokens/s; accuracy / TPF / NFE / projection are per task
        overall = _row(d, "all", all_idx, res, seconds, flops_by, n_blocks, gen_length, proj, proj_b)
        drows = []
        for task in rc.tasks:
            idx = [i for i, it in enumerate(items) if it[0] == task]
            r = _row(d, task, idx, res, seconds, flops_by, n_blocks, gen_length, proj, proj_b)
            r["tps"] = overall["tps"]
            drows.append(r)
        overall["accuracy"] = float(np.mean([r["accuracy"] for r in drows]))
        overall.update(decode_seconds=seconds, decode_seconds_runs=runs[d.name], repeats=len(runs[d.name]),
                       tps_runs=[overall["non_eos_tokens"] / s if s > 0 else 0.0 for s in runs[d.name]],
                       repeat_outputs_identical=same[d.name], compile_seconds=compile_s[d.name],
                       executables=compiled[d.name])
        rows += drows + [overall]
        per_item[d.name] = res["output"]
    load_after = _loadavg()
    result = {
        "benchmark": "bench.run",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "model": bm.model_dir,
        "config": dict(dataclasses.asdict(rc), gen_length=gen_length, block_length=block_length, batch=batch,
                       prompt_slot=slot, decoders_run=[d.name for d in decoders]),
        "decoders": {d.name: dict(dataclasses.asdict(d)) for d in decoders},
        "executables_compiled": sum(compiled.values()),
        "machine": _machine(),
        "load_before": load_before,
        "load_after": load_after,
        "notes": _notes(rc),
        "gpu_check": gpu,
        "rows": rows,
        "total_seconds": time.perf_counter() - t_start,
    }
    if out_dir and leader:
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


def gpu_check_table(path: str, slot: int, gen_length: int, block_length: int) -> dict:
    """Measured step times of a :mod:`bench.gpu_check` JSON (``est_model_depth_ms``: the LM head + model
    layers x the measured per-layer time) next to the roofline projection of the same kind at the check's
    own layout, and whether that layout is this run's (only then do the times price this run's forwards)."""
    try:
        with open(path) as f:
            data = json.load(f)
        c = data["config"]
        layout = (int(c["prompt_length"]), int(c["gen_length"]), int(c["block_length"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PolestarError(f"--gpu-check {path}: not a bench.gpu_check JSON ({type(e).__name__}: {e})") from None
    kinds = []
    for r in data.get("results", []):
        if r.get("status") != "ok" or r.get("est_model_depth_ms") is None:
            continue
        proj = _roofline(layout[0], layout[1], layout[2], r["kind"], None)
        kinds.append({"kind": r["kind"], "kernels": r["kernels"], "measured_ms": r["est_model_depth_ms"],
                      "projected_ms": 1e3 * proj["seconds"], "bound": proj["bound"],
                      "measured_over_projected": r["est_model_depth_ms"] / (1e3 * proj["seconds"])})
    return {"path": path, "device_kind": data.get("device_kind"), "is_gpu": data.get("is_gpu"),
            "date": data.get("date"), "layout": list(layout),
            "matches_run_layout": layout == (slot, gen_length, block_length), "kinds": kinds}


def _notes(rc: RunConfig) -> list[str]:
    return [
        "accuracy: exact match on held-out instances (bench.tasks eval seeds); 'all' = mean over tasks.",
        "tpf: non-EOS generated tokens / forwards (the paper's TPF); tpf_all_positions counts every generated "
        "position.",
        "tps: non-EOS generated tokens / decode-loop seconds of the decoder over all tasks (batched, compile "
        "excluded); the same value on every task row of a decoder. Unsuffixed rows: over the median time of "
        "`repeats` decodes of the whole job (= the median tokens/s for an odd count; tps_runs, "
        "decode_seconds_runs; repeat_outputs_identical checks the tokens); sweep rows "
        "(<decoder>@<threshold>): one decode.",
        "instance i of the job decodes as row i (its random draws come from (seed, i)), whatever the batch.",
        "fastdllm-dual: Fast-dLLM's reference loop (one more step after a full pass that filled the block); "
        "fastdllm-dual-checked: the checked loop (as Polestar's).",
        "polestar-refresh-only: early_threshold=None, suffix_precommit=False; polestar-commit-only: "
        "refresh=False, suffix_precommit=False (early commit on: its token drift needs no refresh).",
        "sweep: thresholds " + ", ".join(f"{t:g}" for t in rc.sweep) + " for " + ", ".join(SWEPT)
        + "; Polestar's early threshold stays 0.7 where it lies below the threshold, else threshold - 0.2 "
          "(0.5 at 0.7).",
        *(["variants: polestar[knob=value,...] rows are polestar (threshold 0.9) with those knobs changed "
           "(--variant), decoded once; diagnostics, not tuned settings."] if rc.variants else []),
        "forwards_*: forwards per instance by kind (full passes, Polestar windowed starts, cached steps "
        "without refresh, refresh steps); refresh_rows_computed: window rows a refresh step computes per "
        "layer at batch 1 (smallest compiled width holding the row's selection; mean over layers and steps).",
        "tps_h200_projection: a MODEL, not a measurement: non-EOS tokens / the projected seconds of one H200 "
        "(bf16, batch 1, LLaDA-8B shapes from tests/data/llada8b_config.json, this run's layout) running each "
        "instance's forwards at max(bytes / 4.8 TB/s, FLOPs / 989 TFLOP/s) per forward (bench.gpu_check "
        "bytes_model + matmul-formula FLOPs); per task. tps_h200_projection_b32: the same at batch 32 (each "
        "forward a 32nd of a batch-32 forward of its kind: weights read once per batch, so FLOPs count; "
        "optimistic: perfect packing, each refresh at its row's own width).",
        "gflops_per_token: FLOPs of the forwards run / generated positions, per forward kind from "
        + ("XLA cost analysis of one compiled forward" if rc.flops else "the matmul formula")
        + " (windowed passes counted as full passes).",
    ]


def _forward_flops(params, mcfg: ModelConfig, slot: int, gen_length: int, block_length: int,
                   xla: bool) -> dict[str, float]:
    """GFLOP of one forward of each kind (batch 1) for this model and layout: from XLA's cost analysis of
    the compiled forward with the layer scan unrolled (``xla``; see
    :func:`bench.bench_decoders.bench_forwards`), else from the matmul formula (no compile)."""
    from bench import bench_decoders as BD

    if not xla:
        length = slot + gen_length
        r_rows = PolestarConfig().window_rows(block_length)
        q = {"full": length, "prefix_step": gen_length, "dual_step": block_length,
             "polestar_step": block_length, "polestar_refresh_step": block_length + r_rows}
        return {k: BD.analytic_flops(mcfg, rows, length, block_length) / 1e9 for k, rows in q.items()}
    bc = BD.BenchConfig(name="tasks", n_layers=mcfg.n_layers, d_model=mcfg.d_model, n_heads=mcfg.n_heads,
                        mlp_hidden=mcfg.mlp_hidden_size, vocab=mcfg.embedding_size, prompt_length=slot,
                        gen_length=gen_length, block_length=block_length, steps=gen_length, forward_warmup=0,
                        forward_reps=1, flops=True)
    prompt = [mcfg.eos_token_id] * slot
    return BD.gflops_by_kind(BD.bench_forwards(params, mcfg, prompt, bc))


def _machine() -> dict:
    from bench.bench_decoders import machine_info

    return dict(machine_info(), loadavg=_loadavg())


# ------------------------------------------------------------------------------------------ the frontier


def _curves(rows: list[dict]) -> dict[str, list[dict]]:
    """Swept decoder -> its 'all' rows, by ascending threshold."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        if r["task"] == "all" and r.get("curve"):
            out.setdefault(r["curve"], []).append(r)
    return {k: sorted(v, key=lambda r: r["threshold"]) for k, v in out.items()}


def _at_accuracy(curve: list[dict], acc: float, keys: Sequence[str]) -> Optional[dict]:
    """The curve's best ``keys[0]`` at accuracy ``acc``: linear interpolation between neighbouring
    thresholds whose accuracies bracket ``acc`` (the bracket with the highest ``keys[0]`` wins, all ``keys``
    taken from it); None when ``acc`` lies outside the curve's accuracy range."""
    best = None
    for a, b in zip(curve, curve[1:]):
        lo, hi = sorted((a["accuracy"], b["accuracy"]))
        if not lo - 1e-12 <= acc <= hi + 1e-12:
            continue
        span = b["accuracy"] - a["accuracy"]
        if abs(span) < 1e-12:  # flat: either end has this accuracy; take the better one
            cands = [a, b]
            p = max(cands, key=lambda r: r.get(keys[0]) or 0.0)
            got = {k: p.get(k) for k in keys}
            got["between"] = (p["threshold"], p["threshold"])
        else:
            t = (acc - a["accuracy"]) / span
            got = {k: (None if a.get(k) is None or b.get(k) is None else a[k] + t * (b[k] - a[k])) for k in keys}
            got["between"] = (a["threshold"], b["threshold"])
        if best is None or (got[keys[0]] or 0.0) > (best[keys[0]] or 0.0):
            best = got
    if best is None and len(curve) == 1 and abs(curve[0]["accuracy"] - acc) < 1e-12:
        best = {k: curve[0].get(k) for k in keys}
        best["between"] = (curve[0]["threshold"],) * 2
    return best


def frontier_readoff(rows: list[dict], base: str = "fastdllm-dual-checked", other: str = "polestar"
                     ) -> list[dict]:
    """For every point of ``other``'s curve: its accuracy, TPF, tokens/s and projected H200 tokens/s, and
    ``base``'s at the same accuracy (:func:`_at_accuracy`; None outside ``base``'s accuracy range), with the
    ratios ``other / base``; also ``base`` at the same threshold."""
    curves = _curves(rows)
    if base not in curves or other not in curves:
        return []
    keys = ("tpf", "tps", "tps_h200_projection")
    by_t = {r["threshold"]: r for r in curves[base]}
    out = []
    for p in curves[other]:
        m = _at_accuracy(curves[base], p["accuracy"], keys)
        ratio = lambda k, ref: (p.get(k) / ref[k] if ref and ref.get(k) and p.get(k) is not None else None)
        same = by_t.get(p["threshold"])
        out.append({
            "threshold": p["threshold"], "accuracy": p["accuracy"],
            **{k: p.get(k) for k in keys},
            "base_at_accuracy": m,
            **{f"{k}_ratio_at_accuracy": ratio(k, m) for k in keys},
            "base_same_threshold": None if same is None else {"accuracy": same["accuracy"],
                                                              **{k: same.get(k) for k in keys}},
            **{f"{k}_ratio_same_threshold": ratio(k, same) for k in keys},
        })
    return out


# ------------------------------------------------------------------------------------------------ report


def _x(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec) + "x"


def markdown(result: dict) -> str:
    rows = result["rows"]
    cfg = result["config"]
    names = list(result["decoders"])
    tasks = list(cfg["tasks"])
    overall = {r["decoder"]: r for r in rows if r["task"] == "all"}
    base = overall.get("llada")
    has_proj = any("tps_h200_projection" in r for r in overall.values())
    lines = [
        f"Model `{os.path.basename(result['model'].rstrip('/'))}`, {cfg['n']} held-out instances per task, "
        f"gen {cfg['gen_length']}, block {cfg['block_length']}, batch {cfg['batch']}, prompt slot "
        f"{cfg['prompt_slot']}; {result['date']}; load average before {result.get('load_before')}, after "
        f"{result.get('load_after')}; block programs compiled over the run (one per decoder and shape, "
        f"persistent-cache loads included): {result.get('executables_compiled', '-')}.",
        "",
        "`tokens/s` is measured on this machine (unsuffixed rows: median of "
        f"{cfg.get('repeats', 1)} decodes); `H200 tokens/s (projection)` is a MODEL: LLaDA-8B shapes, bf16, "
        "batch 1, each forward this decoder ran here at its roofline cost (max(bytes / 4.8 TB/s, FLOPs / "
        "989 TFLOP/s), bench.gpu_check's byte and FLOP models) -- not a measurement. The batch-"
        f"{PROJECTION_BATCH} column prices each forward as a {PROJECTION_BATCH}th of a batch forward of its kind "
        "(weights read once per batch, so FLOPs count; optimistic: perfect packing, refresh at the row's own width).",
        "",
        "| decoder | threshold | accuracy | TPF | tokens/s | speed-up | H200 tokens/s (projection) | "
        f"H200 tokens/s, batch {PROJECTION_BATCH} (projection) | NFE | "
        "full / windowed / step / refresh forwards | refresh rows | GFLOP/token | refresh rate | early | suffix | "
        "compile s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        r = overall[n]
        speed = r["tps"] / base["tps"] if base and base["tps"] > 0 else None
        mix = " / ".join(f"{r.get(k, 0):.2f}" for k in ("forwards_full", "forwards_windowed", "forwards_step",
                                                          "forwards_refresh"))
        lines.append(
            f"| {n} | {_fmt(r.get('threshold'), 'g')} | {100 * r['accuracy']:.1f}% | {r['tpf']:.2f} | "
            f"{r['tps']:.1f} | {_x(speed)} | {_fmt(r.get('tps_h200_projection'), '.1f')} | "
            f"{_fmt(r.get(f'tps_h200_projection_b{PROJECTION_BATCH}'), '.0f')} | {r['nfe']:.2f} | "
            f"{mix} | {_fmt(r.get('refresh_rows_computed'), '.1f')} | {_fmt(r.get('gflops_per_token'), '.4f')} | "
            f"{_fmt(r.get('refresh_rate'))} | {_fmt(r.get('early_commits'))} | {_fmt(r.get('suffix_commits'))} | "
            f"{r['compile_seconds']:.1f} |")
    ro = frontier_readoff(rows)
    if ro:
        lines += ["", "Frontier read-off: each `polestar` point against `fastdllm-dual-checked` at the same "
                  "accuracy (linear interpolation between the neighbouring thresholds of its curve whose "
                  "accuracies bracket Polestar's) and at the same threshold. Ratios are polestar / checked "
                  "dual cache.", "",
                  "| threshold | polestar accuracy | polestar TPF | dual-checked TPF at that accuracy "
                  "(between thresholds) | TPF ratio | tokens/s ratio | H200 projection ratio | same threshold: "
                  "dual-checked accuracy / TPF | TPF ratio | tokens/s ratio | H200 projection ratio |",
                  "|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|"]
        accs = [r["accuracy"] for r in _curves(rows)["fastdllm-dual-checked"]]
        for p in ro:
            m, s = p["base_at_accuracy"], p["base_same_threshold"]
            if m is None:  # outside the checked dual cache's accuracy range
                mcell = (f"never reached (max {100 * max(accs):.1f}%)" if p["accuracy"] > max(accs)
                         else f"below its range (min {100 * min(accs):.1f}%)")
            else:
                mcell = f"{m['tpf']:.2f} ({m['between'][0]:g}-{m['between'][1]:g})"
            scell = "-" if s is None else f"{100 * s['accuracy']:.1f}% / {s['tpf']:.2f}"
            lines.append(
                f"| {p['threshold']:g} | {100 * p['accuracy']:.1f}% | {p['tpf']:.2f} | {mcell} | "
                f"{_x(p['tpf_ratio_at_accuracy'], '.3f')} | {_x(p['tps_ratio_at_accuracy'])} | "
                f"{_x(p['tps_h200_projection_ratio_at_accuracy'])} | {scell} | "
                f"{_x(p['tpf_ratio_same_threshold'], '.3f')} | {_x(p['tps_ratio_same_threshold'])} | "
                f"{_x(p['tps_h200_projection_ratio_same_threshold'])} |")
    main_names = [n for n in names if not result["decoders"][n].get("sweep_point")]
    lines += ["", "Accuracy per task (TPF in parentheses; unsuffixed decoders):", "",
              "| task | " + " | ".join(main_names) + " |", "|---|" + "---:|" * len(main_names)]
    by = {(r["decoder"], r["task"]): r for r in rows}
    for t in tasks:
        cells = [f"{100 * by[(n, t)]['accuracy']:.1f}% ({by[(n, t)]['tpf']:.2f})" for n in main_names]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    if not has_proj:
        lines += ["", "(no H200 projection in this run)"]
    gpu = result.get("gpu_check")
    if gpu:
        lay = "x".join(str(v) for v in gpu["layout"])
        lines += ["", f"Measured step times (`{gpu['path']}`, {gpu['device_kind']}, {gpu['date']}; layout prompt x gen "
                  f"x block {lay}" + ("" if gpu["matches_run_layout"] else ", NOT this run's layout")
                  + ("" if gpu["is_gpu"] else "; NOT A GPU") + ") next to the roofline projection of the same "
                  "kind at that layout:", "",
                  "| kind | kernels | measured ms (est. full depth) | projected ms (roofline) | bound | "
                  "measured / projected |", "|---|---|---:|---:|---|---:|"]
        for k in gpu["kinds"]:
            lines.append(f"| {k['kind']} | {k['kernels']} | {k['measured_ms']:.3f} | {k['projected_ms']:.3f} | "
                         f"{k['bound']} | {k['measured_over_projected']:.2f} |")
    return "\n".join(lines)


def frontier_plot(rows: list[dict], path: str) -> Optional[str]:
    """Accuracy against tokens/s, measured (left) and the H200 projection (right, a model): one curve per
    swept decoder through its thresholds, one point per other decoder; returns the path, or None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("[run] matplotlib is not installed (pip install -e '.[bench]'): no frontier.png")
        return None
    pts = [r for r in rows if r["task"] == "all"]
    curves = _curves(rows)
    on_curve = {r["decoder"] for c in curves.values() for r in c}
    panels = [("tps", "tokens/s, this machine (measured)")]
    if all(r.get("tps_h200_projection") for r in pts):
        panels.append(("tps_h200_projection", "tokens/s, one H200 at LLaDA-8B shapes (PROJECTION: a model)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels) + 3.2, 4.6), dpi=120, squeeze=False)
    markers = "osD^vP*X<>"
    for ax, (key, label) in zip(axes[0], panels):
        for name, c in curves.items():
            ts = ", ".join(format(r["threshold"], "g") for r in c)
            line, = ax.plot([r[key] for r in c], [100 * r["accuracy"] for r in c], "-o", ms=5,
                            label=f"{name} (thresholds {ts})")
            for r in c:
                ax.annotate(f"{r['threshold']:g}", (r[key], 100 * r["accuracy"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=6, color=line.get_color())
        others = [r for r in pts if r["decoder"] not in on_curve]
        for i, r in enumerate(others):  # a legend, not labels: decoders with equal accuracy sit side by side
            ax.scatter(r[key], 100 * r["accuracy"], s=40, marker=markers[i % len(markers)],
                       color=f"C{(len(curves) + i) % 10}", label=f"{r['decoder']} (TPF {r['tpf']:.2f})")
        ax.set_xlabel(label)
        ax.set_ylabel("accuracy (%, mean over tasks)")
        ax.grid(alpha=0.3)
    # one legend, outside the panels (inside, it hid points)
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    axes[0][0].set_title("accuracy vs throughput")
    if len(panels) > 1:
        axes[0][1].set_title("same forwards, H200 roofline projection (model)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="8 instances per task, FLOPs from the matmul formula, one repeat")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output folder (default %(default)s; '' writes nothing)")
    ap.add_argument("--model", default="", help="model folder (default: the bundled trained model)")
    ap.add_argument("--n", type=int, default=None, help="instances per task (default 100, --quick 8)")
    ap.add_argument("--batch", type=int, default=RunConfig.batch, help="rows per decode batch")
    ap.add_argument("--tasks", default=None,
                    help=f"comma-separated tasks or groups ({', '.join(TASK_GROUPS)}; default tiny_tasks); "
                         f"tasks: {','.join(T.TASKS)}")
    ap.add_argument("--decoders", default=None,
                    help=f"comma-separated subset of {','.join(DECODER_NAMES)}, or <decoder>@<threshold> "
                         f"for one of {','.join(SWEPT)}")
    ap.add_argument("--sweep", default=",".join(f"{t:g}" for t in SWEEP_THRESHOLDS),
                    help=f"thresholds swept for {', '.join(SWEPT)} (default %(default)s; 0.9 is the "
                         "unsuffixed row)")
    ap.add_argument("--no-sweep", action="store_true", help="no threshold sweep")
    ap.add_argument("--variant", action="append", default=[], metavar="FLAGS",
                    help="also decode polestar with these generate flags changed, e.g. '--top-k 8 "
                         "--suffix-blocks 2', or --variant=--no-suffix-commit for one flag without a value "
                         "(repeatable; a diagnostic row, decoded once)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="decodes of the job per unsuffixed decoder, tokens/s = the median (default 3, --quick 1)")
    ap.add_argument("--seed", type=int, default=0, help="job seed (instance i gets (seed, i))")
    ap.add_argument("--gen-length", type=int, default=None)
    ap.add_argument("--block-length", type=int, default=None)
    ap.add_argument("--no-flops", action="store_true", help="FLOPs from the matmul formula, not XLA")
    ap.add_argument("--no-projection", action="store_true", help="no H200 projection column")
    ap.add_argument("--gpu-check", default="", metavar="JSON",
                    help="a bench.gpu_check JSON (ideally run at this layout: --prompt-length <slot> "
                         "--gen-length <gen> --block-length <block>): its measured step times are tabled next "
                         "to the projection")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-early-exit", action="store_true",
                    help="decode every block of every row (the reference's accounting; default: a row stops "
                         "after the first finished block that holds a stop token)")
    ap.add_argument("--mesh", default="", help="decode over a device mesh, e.g. data=2,model=4 (with several "
                                               "processes: over all their devices; FLOPs from the matmul formula)")
    cli.add_distributed_flags(ap)
    args = ap.parse_args(argv)
    base = QUICK if args.quick else RunConfig()
    try:
        sweep = () if args.no_sweep else _floats(args.sweep)
    except ValueError:
        ap.error("--sweep takes comma-separated thresholds")
    rc = dataclasses.replace(
        base, model=args.model, batch=args.batch, gen_length=args.gen_length, block_length=args.block_length,
        n=args.n if args.n is not None else base.n, flops=base.flops and not args.no_flops,
        tasks=expand_tasks(args.tasks) if args.tasks else base.tasks,
        decoders=tuple(args.decoders.split(",")) if args.decoders else base.decoders, sweep=sweep,
        variants=tuple(args.variant),
        repeats=args.repeats if args.repeats is not None else base.repeats, seed=args.seed,
        projection=not args.no_projection, gpu_check=args.gpu_check, mesh=args.mesh,
        early_exit=not args.no_early_exit)
    if rc.n <= 0 or rc.batch <= 0 or rc.repeats <= 0:
        print("error: --n, --batch and --repeats must be positive", file=sys.stderr)
        return 2
    command = "python -m bench.run " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    try:
        cli.join_from_args(args)  # several processes (flags or environment): before anything uses a device
        result = run(rc, args.out, command=command.strip(), progress=not args.no_progress)
    except PolestarError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if not sharding.is_leader():  # every process has the results; process 0 prints them
        return 0
    print(markdown(result))
    if args.out:
        print(f"\nwrote {os.path.join(args.out, 'results.json')}, run.json, results.md"
              + (", frontier.png" if result.get("plot") else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
