"""Replays reference data produced by the PyTorch code and reports where JAX agrees.

``python -m polestar_jax.crosscheck DIR [DIR ...]`` accepts three folder formats:

* **LLaDA / Fast-dLLM format**: ``config.json`` + ``model.safetensors`` + ``cases.json`` with
  ``logits_cases`` (logits, optionally per-layer hidden states, compared within ``1e-4 + 1e-4*|ref|``)
  and ``generate_cases`` (output ids, NFE and commits per forward must match exactly; a failure names
  the first forward whose commits differ). A LLaDA-MoE folder (``architectures`` ["LLaDAMoEModelLM"]) runs
  its family's forward; its mask id comes from ``cases.json -> model`` when config.json has none (as the real
  one), and a case's ``router_file`` must give every token's expert set in every layer.
* **Polestar format**: ``config.json`` + ``model.safetensors`` + run files
  ``*_<method>_g<gen>_b<block>_s<steps>.json`` (``cases``: prompt, output ids, NFE, ``block_stats``).
  Methods ``plain_steps``, ``plain_thr<t>`` and ``dual_cache_nocluster`` replay without injection;
  ``polestar`` runs take the k-means draws and labels and the per-layer cluster selections from
  ``traces/<stem>.trace.json`` and ``decisions/<stem>_case<i>.json`` and compute everything else; the
  output ids, NFE and ``block_stats`` must match, and the replay reports how often this implementation's
  own cluster choice differed from the injected one, and by what score margin.

* **Dream format** (``config.json`` with ``model_type`` "Dream", made by the official Polestar Dream code):
  ``cases.json`` with raw ``logits_cases`` (the hidden states of ``meta.hidden_states_file`` are checked
  with the case of the same input) and ``generate_cases`` named ``method/p<i>/g<gen>_b<block>_s<steps>``
  (``dual_nocluster_thr``, ``dual_nocluster_sched``, ``plain_thr``, ``polestar``, ``polestar_noearly``): output
  ids, NFE and the commits of every forward must match exactly; Polestar cases take the k-means draws,
  labels and cluster selections from their ``trace`` / ``decisions`` files, decide the structural ties by
  rule (``PolestarConfig.tie_break``) and must match ``block_stats`` too; the detail reports the own
  cluster choices and how the structural ties were decided. A case that cannot run is a failure.

* **LLaDA-V format** (``config.json`` with ``model_type`` "llava_llada", made by the official Polestar LLaDA-V
  code; the weights may be ``model.safetensors.gz``): ``cases.json`` with first-pass ``logits_cases`` per
  image (spliced prompt rows, logits, final hidden states, rotated layer-0 keys, every row's argmax and
  maximum probability) and ``generate_cases`` named ``method/<image>/q<i>/g<gen>_b<block>_s<steps>``
  (``polestar``: decoder ``polestar_v`` with the k-means draws, final labels and cluster selections of
  ``decisions/<stem>.json.gz`` injected; ``fastdllm_prefix``: Fast-dLLM's prefix cache): output ids, NFE,
  the commits of every forward and each block's NFE must match exactly; the detail of a Polestar case says
  how often the own labels and cluster choice differed from the injected ones.

The last line is ``N passed, M failed[, K skipped]``; the exit status is 1 when anything failed and 2 for
bad input (missing folder, unreadable files).
"""
from __future__ import annotations

if __name__ == "__main__":  # first of all: Ctrl-C from here on ends cleanly (polestar_jax.cli takes over)
    import os as _os
    import signal as _signal

    _signal.signal(_signal.SIGINT, lambda *_: (_os.write(2, b"interrupted\n"), _os._exit(130)))

import dataclasses
import glob
import json
import os
import re
import sys
from typing import Any, Callable, Optional, Sequence

import numpy as np

from polestar_jax.errors import PolestarError

LOGITS_ATOL = 1e-4
LOGITS_RTOL = 1e-4


@dataclasses.dataclass
class CaseResult:
    name: str
    status: str  # "pass" | "fail" | "skip"
    detail: str = ""


# --------------------------------------------------------------------------------------------- helpers
def _budget_used(out: np.ndarray, ref: np.ndarray) -> float:
    """Largest |out - ref| as a fraction of the tolerance ``1e-4 + 1e-4*|ref|`` (<= 1 passes)."""
    return float(np.max(np.abs(out - ref) / (LOGITS_ATOL + LOGITS_RTOL * np.abs(ref))))


def first_divergence(ours: list[list[tuple[int, int]]], ref: list[list[tuple[int, int]]]) -> Optional[str]:
    """Describes the first forward whose set of (position, token) commits differs, or None."""
    for f in range(max(len(ours), len(ref))):
        a = sorted(map(tuple, ours[f])) if f < len(ours) else None
        b = sorted(map(tuple, ref[f])) if f < len(ref) else None
        if a != b:
            return f"first diverging forward {f}: ours {a} vs reference {b}"
    return None


def _reference(dcfg):
    """``dcfg`` with the reference code's accounting: every block decoded (the PyTorch code has no early
    exit, and its NFE and block statistics count every block)."""
    return dataclasses.replace(dcfg, early_exit=False)


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PolestarError(f"{path}: cannot read JSON ({e})") from None


# ------------------------------------------------------------------------------ LLaDA / Fast-dLLM format
FUNCTION_TO_DECODER = {
    "llada.generate": ("llada", "none"),
    "fastdllm.generate": ("fastdllm", "none"),
    "fastdllm.generate_with_prefix_cache": ("fastdllm", "prefix"),
    "fastdllm.generate_with_dual_cache": ("fastdllm", "dual"),
}


def decode_config_for_case(case: dict):
    """The :class:`DecodeConfig` that reproduces one ``generate_cases`` entry (raises on unknown ones)."""
    from polestar_jax.config import DecodeConfig

    fn = case.get("function")
    if fn not in FUNCTION_TO_DECODER:
        raise PolestarError(f"unknown function {fn!r}")
    s = case["settings"]
    decoder, cache = FUNCTION_TO_DECODER[fn]
    if s.get("remasking", "low_confidence") != "low_confidence":
        raise PolestarError(f"remasking {s.get('remasking')!r} draws torch random numbers; cannot replay")
    if float(s.get("temperature", 0.0)) != 0.0:
        raise PolestarError("temperature > 0 draws torch random numbers; cannot replay")
    if float(s.get("cfg_scale", 0.0) or 0.0) != 0.0 or s.get("logits_eos_inf") or s.get("confidence_eos_eot_inf"):
        raise PolestarError("cfg_scale / logits_eos_inf / confidence_eos_eot_inf are not supported")
    return DecodeConfig(decoder=decoder, cache=cache, gen_length=int(s["gen_length"]),
                        block_length=int(s["block_length"]), steps=int(s["steps"]),
                        threshold=None if s.get("factor") is not None else s.get("threshold"),
                        factor=s.get("factor"))  # Fast-dLLM: a factor overrides the threshold


def _check_generation(name, result, row, prompt_len, want_generated, want_nfe, want_trajectory=None,
                      want_cpf=None, want_block_nfe=None, exact_trajectory: bool = False) -> CaseResult:
    got = result.tokens[row].tolist()
    ours_traj = [[(prompt_len + p, t) for p, t in step] for step in result.trajectory(row)]
    problems = []
    if got != list(want_generated):
        diff = next(i for i, (a, b) in enumerate(zip(got, want_generated)) if a != b)
        problems.append(f"output differs first at generated position {diff}")
    if int(result.nfe[row]) != int(want_nfe):
        problems.append(f"nfe {int(result.nfe[row])} vs reference {want_nfe}")
    if want_cpf is not None and result.commits_per_forward(row) != list(want_cpf):
        problems.append("commits per forward differ")
    if want_block_nfe is not None and result.block_nfe[row].tolist() != list(want_block_nfe):
        problems.append(f"block nfe {result.block_nfe[row].tolist()} vs reference {list(want_block_nfe)}")
    if (problems or exact_trajectory) and want_trajectory is not None:
        where = first_divergence(ours_traj, want_trajectory)
        if where:
            problems.append(where)
    return CaseResult(name, "fail" if problems else "pass", "; ".join(problems))


def replay_llada_folder(folder: str, params, cfg, pad_multiple: int = 16,
                        progress: Callable[[CaseResult], None] = lambda r: None, batch: int = 1,
                        mesh=None) -> list[CaseResult]:
    """Replays every logits case and generate case of a ``cases.json`` folder; generate cases with the
    same settings run ``batch`` at a time."""
    from polestar_jax.engine.engine import Engine, prompt_slot
    engine = Engine(params, cfg, mesh=mesh)  # run with _reference(dcfg): every block decoded, no early exit

    data = _read_json(os.path.join(folder, "cases.json"))
    results: list[CaseResult] = []

    def add(r: CaseResult):
        results.append(r)
        progress(r)

    for case in data.get("logits_cases", []):
        add(_check_logits_case(folder, case, params, cfg))

    gen_cases = data.get("generate_cases", [])
    slot = None
    if gen_cases:
        slot = prompt_slot([len(c["prompt_ids"]) for c in gen_cases], pad_multiple)
    runnable = []
    for case in gen_cases:
        name = case.get("name", "?")
        try:
            dcfg = decode_config_for_case(case)
        except PolestarError as e:
            add(CaseResult(name, "skip", str(e)))
            continue
        if len(case["prompt_ids"]) + dcfg.gen_length > cfg.max_sequence_length:
            add(CaseResult(name, "skip", "longer than max_sequence_length"))
            continue
        runnable.append((case, dcfg))
    # cases with the same decode configuration run ``batch`` at a time (prompts of mixed lengths)
    groups: dict = {}
    for case, dcfg in runnable:
        groups.setdefault(dcfg, []).append(case)
    for dcfg, cases in groups.items():
        for i in range(0, len(cases), batch):
            chunk = cases[i:i + batch]
            res = engine.run([c["prompt_ids"] for c in chunk], _reference(dcfg), prompt_slot=slot)
            for r, case in enumerate(chunk):
                add(_check_generation(case.get("name", "?"), res, r, len(case["prompt_ids"]),
                                      case["generated_ids"], case["nfe"], case.get("trajectory"),
                                      case.get("margins", {}).get("commits_per_forward")))
    return results


def _check_logits_case(folder: str, case: dict, params, cfg) -> CaseResult:
    """One ``logits_cases`` entry: the logits (and hidden states, and a LLaDA-MoE router file: every token's
    expert set) of the model's family within the tolerance."""
    import jax.numpy as jnp

    name = f"logits/{case['name']}"
    try:
        ref = np.load(os.path.join(folder, case["file"]))
        ids = jnp.asarray(np.asarray(case["input_ids"], np.int32))
        out, hs = family_logits(params, ids, cfg, collect_hidden=bool(case.get("hidden_states_file")))
        used = _budget_used(np.asarray(out), ref)
        detail = f"max error {used:.0%} of tolerance"
        ok = used <= 1.0
        if case.get("hidden_states_file"):
            hused = _budget_used(np.asarray(hs), np.load(os.path.join(folder, case["hidden_states_file"])))
            detail += f"; hidden states {hused:.0%}"
            ok = ok and hused <= 1.0
        if case.get("router_file") and cfg.family == "llada_moe":
            from polestar_jax.models.llada_moe import routing

            want = np.sort(np.load(os.path.join(folder, case["router_file"]))["selected_experts"], axis=-1)
            got = np.sort(np.asarray(routing(params, ids, cfg)[1]), axis=-1)
            same = int(np.all(got == want, axis=-1).sum())
            detail += f"; router choices {same}/{want.shape[0] * want.shape[1]} equal"
            ok = ok and got.shape == want.shape and same == want.shape[0] * want.shape[1]
        return CaseResult(name, "pass" if ok else "fail", detail)
    except (OSError, KeyError, ValueError) as e:
        return CaseResult(name, "fail", f"cannot replay: {e}")


def golden_model_config(folder: str):
    """The :class:`ModelConfig` of a golden folder whose ``config.json`` lacks the mask id (LLaDA-MoE's,
    like the real checkpoint's) while ``cases.json -> model`` names it; None when config.json suffices."""
    from polestar_jax.config import ModelConfig

    d = _read_json(os.path.join(folder, "config.json"))
    if not isinstance(d, dict) or "mask_token_id" in d or not os.path.isfile(os.path.join(folder, "cases.json")):
        return None
    model = _read_json(os.path.join(folder, "cases.json")).get("model") or {}
    if "mask_token_id" not in model:
        return None
    return ModelConfig.from_dict({**d, "mask_token_id": model["mask_token_id"]},
                                 source=os.path.join(folder, "config.json"))


# ------------------------------------------------------------------------------------- Polestar format
RUN_FILE = re.compile(r"^(?P<prefix>.*?)_?(?P<method>polestar|dual_cache_nocluster|plain_thr[0-9.]+|plain_steps)"
                      r"_g(?P<gen>\d+)_b(?P<block>\d+)_s(?P<steps>\d+)\.json$")


def polestar_run_files(folder: str) -> list[tuple[str, re.Match]]:
    """Run files of a Polestar-format folder, with their parsed names."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        m = RUN_FILE.match(os.path.basename(path))
        if m:
            out.append((path, m))
    return out


def decode_config_for_method(method: str, gen: int, block: int, steps: int):
    """DecodeConfig of a Polestar-repo baseline method."""
    from polestar_jax.config import DecodeConfig

    if method == "plain_steps":
        return DecodeConfig(decoder="fastdllm", cache="none", gen_length=gen, block_length=block, steps=steps,
                            threshold=None)
    if method.startswith("plain_thr"):
        return DecodeConfig(decoder="fastdllm", cache="none", gen_length=gen, block_length=block, steps=steps,
                            threshold=float(method[len("plain_thr"):]))
    if method == "dual_cache_nocluster":
        return DecodeConfig(decoder="fastdllm", cache="dual", gen_length=gen, block_length=block, steps=steps,
                            threshold=0.9, step_after_full_pass=False)
    raise PolestarError(f"unknown method {method!r}")


def selection_disagreements(result, row: int = 0) -> tuple[int, int, float]:
    """(refresh decisions compared, decisions where the own top-k differs from the injected one, largest
    relative score gap of a differing decision) over all Polestar steps of ``row``."""
    n = diff = 0
    worst = 0.0
    for st in result.steps or []:
        act = np.asarray(st.active)[:, row] & np.asarray(st.cluster)[:, row]
        for i in np.nonzero(act)[0]:
            sel, own = np.asarray(st.selected[i, row]), np.asarray(st.own_selected[i, row])
            sc = np.asarray(st.cluster_scores[i, row])
            for layer in range(sel.shape[0]):
                n += 1
                if (sel[layer] != own[layer]).any():
                    diff += 1
                    a = sc[layer][sel[layer] & ~own[layer]]
                    b = sc[layer][own[layer] & ~sel[layer]]
                    if a.size and b.size:
                        scale = max(float(np.max(np.abs(sc[layer][np.isfinite(sc[layer])]))), 1e-30)
                        worst = max(worst, abs(float(b.max() - a.min())) / scale)
    return n, diff, worst


def _check_polestar_case(name: str, res, row: int, case: dict, method: str) -> CaseResult:
    want = case.get("block_stats", [])
    note = ""
    if method == "polestar":
        keys = ("block_id", "block_nfe", "block0_true", "efficient_true", "cluster_true")
        got_stats = [{k: s[k] for k in keys} for s in res.block_stats(row)]
        want_stats = [{k: s[k] for k in keys} for s in want]
        n, diff, worst = selection_disagreements(res, row)
        note = f"own cluster choice differed in {diff}/{n} layer decisions (max relative gap {worst:.1e})"
    else:
        got_stats = [{"block_id": s["block_id"], "block_nfe": s["block_nfe"]} for s in res.block_stats(row)]
        want_stats = [{"block_id": s["block_id"], "block_nfe": s["block_nfe"]} for s in want]
    r = _check_generation(name, res, row, len(case["prompt_ids"]), case["generated_ids"], case["nfe"])
    if got_stats != want_stats:
        r.status = "fail"
        r.detail = "; ".join(x for x in (r.detail, f"block_stats {got_stats} vs reference {want_stats}") if x)
    if note:
        r.detail = "; ".join(x for x in (r.detail, note) if x)
    return r


def replay_polestar_folder(folder: str, params, cfg, pad_multiple: int = 16,
                           progress: Callable[[CaseResult], None] = lambda r: None, batch: int = 1,
                           mesh=None, kernels: str = "auto",
                           refresh_buckets: Optional[int] = None) -> list[CaseResult]:
    """Replays the run files of a Polestar-format folder (see the module docstring), ``batch`` cases of
    a run file at a time (``refresh_buckets``: the compiled refresh widths, None = PolestarConfig's default;
    the result does not depend on it)."""
    import jax.numpy as jnp

    from polestar_jax.config import DecodeConfig, PolestarConfig
    from polestar_jax.engine.engine import Engine, prompt_slot
    engine = Engine(params, cfg, mesh=mesh)  # run with _reference(dcfg): every block decoded, no early exit
    from polestar_jax.decode.polestar.replay import build_replay

    knobs = {} if refresh_buckets is None else {"refresh_buckets": refresh_buckets}
    results: list[CaseResult] = []
    for path, m in polestar_run_files(folder):
        stem = os.path.basename(path)[:-5]
        data = _read_json(path)
        cases = data["cases"] if isinstance(data, dict) else data
        gen, block, steps = int(m["gen"]), int(m["block"]), int(m["steps"])
        method = m["method"]
        if method == "polestar":
            dcfg = DecodeConfig(decoder="polestar", cache="dual", gen_length=gen, block_length=block,
                                steps=steps, threshold=0.9,
                                polestar=PolestarConfig(kernels=kernels, **knobs))
            traces = _read_json(os.path.join(folder, "traces", stem + ".trace.json"))["traces"]
        else:
            dcfg = decode_config_for_method(method, gen, block, steps)
        slot = prompt_slot([len(c["prompt_ids"]) for c in cases], pad_multiple)
        for c0 in range(0, len(cases), batch):
            chunk = list(enumerate(cases))[c0:c0 + batch]
            names = [f"{stem}/case{i}" for i, _ in chunk]
            try:
                replay = None
                if method == "polestar":
                    reps = [build_replay(traces[i], _read_json(os.path.join(folder, "decisions",
                                                                            f"{stem}_case{i}.json")),
                                         cfg, dcfg.polestar, block, dcfg.num_blocks * (block + 1))
                            for i, _ in chunk]
                    replay = type(reps[0])(*(jnp.concatenate(a, axis=0) for a in zip(*reps)))
                res = engine.run([c["prompt_ids"] for _, c in chunk], _reference(dcfg), prompt_slot=slot,
                                 replay=replay)
            except PolestarError as e:
                for name in names:
                    r = CaseResult(name, "fail", f"cannot replay: {e}")
                    results.append(r)
                    progress(r)
                continue
            for row, ((i, case), name) in enumerate(zip(chunk, names)):
                r = _check_polestar_case(name, res, row, case, method)
                results.append(r)
                progress(r)
    return results


# ---------------------------------------------------------------------------------------- Dream format
def family_logits(params, ids, cfg, collect_hidden: bool = False):
    """Raw (unshifted) logits [b, L, V] of a plain forward over ``ids`` [b, L] with the model's family, and
    (``collect_hidden``) the hidden states [N+1, b, L, D]: every layer's input, then the final norm's output."""
    import jax.numpy as jnp

    from polestar_jax.models import llada
    from polestar_jax.models.family import family_of

    fam = family_of(cfg)
    b, length = ids.shape
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    out = fam.forward(params, ids, cfg, pos, pos, None, collect_hidden=collect_hidden)
    logits = fam.lm_head(params, out.h, cfg)
    if not collect_hidden:
        return logits, None
    final = llada.rms_norm(out.h, params["ln_f"], cfg.rms_norm_eps)
    return logits, jnp.concatenate([out.hidden, final[None]], axis=0)


def dream_decode_config(case: dict, kernels: str = "auto", refresh_buckets: Optional[int] = None):
    """The :class:`DecodeConfig` that reproduces one Dream ``generate_cases`` entry (the official
    ``diffusion_generate`` settings; see ``docs/algorithm.md#dream``); raises :class:`PolestarError` for a
    setting that draws torch random numbers or that the official code cannot run."""
    from polestar_jax.config import DecodeConfig

    s, method = case["settings"], case.get("method", "")
    if float(s.get("temperature", 0.0)) != 0.0:
        raise PolestarError("temperature > 0 draws torch random numbers; cannot replay")
    gen, block, steps = int(s["gen_length"]), int(s["block_length"]), int(s["steps"])
    common = dict(gen_length=gen, block_length=block, steps=steps)
    alg = s.get("alg")
    if not s.get("dual_cache"):
        if alg != "confidence_threshold":
            raise PolestarError(f"no-cache alg {alg!r}: the official sampler crashes (J7) or draws torch "
                                "random numbers (origin); cannot replay")
        return DecodeConfig(decoder="fastdllm", cache="none", threshold=s.get("threshold", 0.9), **common)
    if s.get("use_cluster"):
        return DecodeConfig(decoder="polestar", cache="dual", threshold=s.get("threshold", 0.9),
                            polestar=dream_polestar_config(s.get("threshold_early"), kernels, refresh_buckets),
                            **common)
    if alg == "confidence_threshold":
        return DecodeConfig(decoder="fastdllm", cache="dual", threshold=s.get("threshold", 0.9),
                            step_after_full_pass=False, start_commit="first", **common)
    if alg == "entropy" and not s.get("alg_temp"):
        return DecodeConfig(decoder="fastdllm", cache="dual", threshold=None, step_after_full_pass=False,
                            start_commit="first", schedule="timesteps", rank_by="neg_entropy",
                            schedule_eps=float(s.get("eps", 1e-3)), **common)
    raise PolestarError(f"unsupported Dream method {method!r} (alg {alg!r})")


def dream_polestar_config(threshold_early, kernels: str = "auto", refresh_buckets: Optional[int] = None):
    """The :class:`PolestarConfig` of the official Dream Polestar path: the Dream family's Polestar
    parameters, ``threshold_early`` as given, and the suffix pre-commit off (the official one writes into a
    copy, so it never takes effect: faithful mode, docs/differences.md#d26)."""
    from polestar_jax.models.family import FAMILIES

    knobs = {} if refresh_buckets is None else {"refresh_buckets": refresh_buckets}
    return FAMILIES["dream"].polestar_config(early_threshold=threshold_early, suffix_precommit=False,
                                             kernels=kernels, **knobs)


def replay_dream_folder(folder: str, params, cfg, pad_multiple: int = 16,
                        progress: Callable[[CaseResult], None] = lambda r: None, batch: int = 1,
                        mesh=None, kernels: str = "auto", refresh_buckets: Optional[int] = None) -> list[CaseResult]:
    """Replays a Dream golden folder (``cases.json`` made by the official Dream code): every logits case
    (raw rows; the hidden states with the case whose input they were computed on) and every generate case
    (output ids, NFE and the commits of every forward must match exactly), ``batch`` cases of one setting
    at a time."""
    import jax.numpy as jnp

    from polestar_jax.engine.engine import Engine, prompt_slot
    engine = Engine(params, cfg, mesh=mesh)  # run with _reference(dcfg): every block decoded, no early exit

    data = _read_json(os.path.join(folder, "cases.json"))
    meta = data.get("meta", {})
    results: list[CaseResult] = []

    def add(r: CaseResult):
        results.append(r)
        progress(r)

    hs_file, hs_input = meta.get("hidden_states_file"), meta.get("hidden_states_input")
    hs_done = hs_file is None
    for case in data.get("logits_cases", []):
        name = f"logits/{case.get('name') or os.path.splitext(case['file'])[0]}"
        try:
            ref = np.load(os.path.join(folder, case["file"]))
            with_hs = not hs_done and case["input_ids"] == hs_input
            ids = jnp.asarray(np.asarray(case["input_ids"], np.int32))
            out, hs = family_logits(params, ids, cfg, collect_hidden=with_hs)
            used = _budget_used(np.asarray(out), ref)
            detail, ok = f"max error {used:.0%} of tolerance", used <= 1.0
            if with_hs:
                hused = _budget_used(np.asarray(hs), np.load(os.path.join(folder, hs_file)))
                detail += f"; hidden states {hused:.0%}"
                ok, hs_done = ok and hused <= 1.0, True
            add(CaseResult(name, "pass" if ok else "fail", detail))
        except (OSError, KeyError, ValueError) as e:
            add(CaseResult(name, "fail", f"cannot replay: {e}"))
    if not hs_done:
        try:
            ids = jnp.asarray(np.asarray(hs_input, np.int32))
            hused = _budget_used(np.asarray(family_logits(params, ids, cfg, True)[1]),
                                 np.load(os.path.join(folder, hs_file)))
            add(CaseResult("hidden_states", "pass" if hused <= 1.0 else "fail", f"max error {hused:.0%}"))
        except (OSError, KeyError, ValueError, TypeError) as e:
            add(CaseResult("hidden_states", "fail", f"cannot replay: {e}"))

    gen_cases = data.get("generate_cases", [])
    slot = None
    if gen_cases:
        slot = prompt_slot([len(c["prompt_ids"]) for c in gen_cases], pad_multiple)
    groups: dict = {}
    for case in gen_cases:
        try:
            dcfg = dream_decode_config(case, kernels, refresh_buckets)
        except PolestarError as e:  # a case that cannot run is a failure, not a skip
            add(CaseResult(case.get("name", "?"), "fail", f"cannot replay: {e}"))
            continue
        groups.setdefault(dcfg, []).append(case)
    for dcfg, cases in groups.items():
        for i in range(0, len(cases), batch):
            chunk = cases[i:i + batch]
            try:
                replay_in = None
                if dcfg.decoder == "polestar":
                    replay_in = dream_replay(folder, chunk, cfg, dcfg)
                res = engine.run([c["prompt_ids"] for c in chunk], _reference(dcfg), prompt_slot=slot,
                                 replay=replay_in)
            except PolestarError as e:
                for case in chunk:
                    add(CaseResult(case.get("name", "?"), "fail", f"cannot replay: {e}"))
                continue
            for r, case in enumerate(chunk):
                if dcfg.decoder == "polestar":
                    add(_check_dream_polestar_case(case, res, r))
                    continue
                add(_check_generation(case.get("name", "?"), res, r, len(case["prompt_ids"]),
                                      case["generated_ids"], case["nfe"], case.get("trajectory"),
                                      case.get("margins", {}).get("commits_per_forward"), exact_trajectory=True))
    return results


def dream_replay(folder: str, cases: list, cfg, dcfg):
    """The :class:`~polestar_jax.decode.polestar.draws.Replay` of Dream Polestar cases (one row per case): the k-means draws
    and labels and the per-layer cluster selections of each case's ``trace`` / ``decisions`` files. The
    structural ties (``docs/differences.md#d27``) are not injected: ``PolestarConfig.tie_break="shared_row"``
    decides them."""
    import jax.numpy as jnp

    from polestar_jax.decode.polestar.replay import build_replay

    reps = []
    for case in cases:
        if not case.get("trace") or not case.get("decisions"):
            raise PolestarError(f"{case.get('name', '?')}: no trace / decisions file named")
        trace = _read_json(os.path.join(folder, case["trace"]))
        trace = trace.get("trace", trace)
        decisions = _read_json(os.path.join(folder, case["decisions"]))
        reps.append(build_replay(trace, decisions, cfg, dcfg.polestar, dcfg.block_length,
                                 dcfg.num_blocks * (dcfg.block_length + 1)))
    return type(reps[0])(*(jnp.concatenate(a, axis=0) for a in zip(*reps)))


def structural_tie_agreement(case: dict, res, row: int) -> tuple[int, int]:
    """(structural ties of ``case``, those decided as the official code decided them): the ties between
    block positions 0 and 1 (``docs/differences.md#d27``; ``structural_ties`` in ``cases.json``); a tie counts
    as agreeing when this run committed, at that forward, exactly the official (position, token) pairs (the
    rule's pick plus any early commit)."""
    ties = case.get("structural_ties") or []
    p = len(case["prompt_ids"])
    traj, ref = res.trajectory(row), case.get("trajectory") or []
    agree = 0
    for t in ties:
        call = int(t["call"])
        ours = sorted((p + j, tok) for j, tok in traj[call]) if call < len(traj) else None
        want = sorted(map(tuple, ref[call])) if call < len(ref) else None
        agree += ours is not None and ours == want
    return len(ties), agree


def _check_dream_polestar_case(case: dict, res, row: int) -> CaseResult:
    """A Dream Polestar case: output ids, NFE, the commits of every forward and ``block_stats`` exactly; the
    note says how often the own cluster choice differed from the injected one and how the structural ties
    were decided."""
    name = case.get("name", "?")
    r = _check_generation(name, res, row, len(case["prompt_ids"]), case["generated_ids"], case["nfe"],
                          case.get("trajectory"), case.get("margins", {}).get("commits_per_forward"),
                          exact_trajectory=True)
    keys = ("block_id", "block_nfe", "block0_true", "efficient_true", "cluster_true")
    got_stats = [{k: s[k] for k in keys} for s in res.block_stats(row)]
    want_stats = [{k: s[k] for k in keys} for s in case.get("block_stats", [])]
    if got_stats != want_stats:
        r.status = "fail"
        r.detail = "; ".join(x for x in (r.detail, f"block_stats {got_stats} vs reference {want_stats}") if x)
    n, diff, worst = selection_disagreements(res, row)
    n_ties, agree = structural_tie_agreement(case, res, row)
    note = (f"own cluster choice differed in {diff}/{n} layer decisions (max relative gap {worst:.1e}); "
            f"structural ties decided as the official code: {agree}/{n_ties}")
    r.detail = "; ".join(x for x in (r.detail, note) if x)
    return r


def _model_type(folder: str) -> Optional[str]:
    """The ``model_type`` of a folder's ``config.json`` (None when it has none or cannot be read)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


# -------------------------------------------------------------------------------------- LLaDA-V format
def llada_v_model_folder(folder: str, scratch: str) -> str:
    """A loadable model folder for a LLaDA-V golden folder: ``folder`` itself when it has its weights, else
    ``scratch`` with ``model.safetensors.gz`` unpacked beside the config and the tower folder (linked)."""
    import gzip
    import shutil

    if not os.path.isfile(os.path.join(folder, "model.safetensors.gz")) or os.path.isfile(
            os.path.join(folder, "model.safetensors")):
        return folder
    os.makedirs(scratch, exist_ok=True)
    for name in os.listdir(folder):
        src, dst = os.path.abspath(os.path.join(folder, name)), os.path.join(scratch, name)
        if name == "config.json" or (os.path.isdir(src) and os.path.isfile(os.path.join(src, "config.json"))):
            if not os.path.lexists(dst):
                os.symlink(src, dst)
    try:
        with gzip.open(os.path.join(folder, "model.safetensors.gz")) as f, \
                open(os.path.join(scratch, "model.safetensors"), "wb") as out:
            shutil.copyfileobj(f, out)
    except (OSError, EOFError) as e:
        raise PolestarError(f"{folder}: cannot unpack model.safetensors.gz ({e})") from None
    return scratch


def llada_v_decode_config(case: dict):
    """The :class:`DecodeConfig` of one LLaDA-V ``generate_cases`` entry: ``polestar`` (``use_cluster=True``)
    is decoder ``polestar_v``, ``fastdllm_prefix`` Fast-dLLM's prefix cache (no step after a full pass that
    filled the block)."""
    from polestar_jax.config import DecodeConfig, PolestarConfig

    s = case["settings"]
    if float(s.get("temperature", 0.0)) != 0.0:
        raise PolestarError("temperature > 0 draws torch random numbers; cannot replay")
    common = dict(gen_length=int(s["gen_length"]), block_length=int(s["block_length"]), steps=int(s["steps"]),
                  threshold=s.get("threshold", 0.9))
    if s.get("use_cluster"):
        return DecodeConfig(decoder="polestar_v", cache="prefix",
                            polestar=PolestarConfig(early_threshold=s.get("threshold_early")), **common)
    return DecodeConfig(decoder="fastdllm", cache="prefix", step_after_full_pass=False, **common)


def _llada_v_logits_case(folder: str, tag: str, case: dict, params, cfg, rows) -> CaseResult:
    """A first-pass case: spliced prompt rows, logits (active columns; the others exactly 0), final hidden
    states, layer-0 rotated keys, and the full-vocabulary argmax / max probability of every row."""
    import jax
    import jax.numpy as jnp

    from polestar_jax.models import llada
    from polestar_jax.models import llada_v as lv

    name = f"logits/{tag}"
    try:
        pe = lv.splice(params, case["input_ids"], [rows], cfg)
        used = {"prompt rows": _budget_used(np.asarray(pe[::4]), np.load(os.path.join(folder,
                                                                                       case["prompt_embeds_file"])))}
        gen = case["total_len"] - case["prompt_len"]
        x = jnp.concatenate([pe, jnp.broadcast_to(params["wte"][cfg.mask_token_id], (gen, cfg.d_model))])[None]
        pos = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
        out = lv.forward(params, None, cfg, pos, pos, None, embeds=x)
        r0, r1 = case["rows"]
        with open(os.path.join(folder, "recipe.json")) as f:
            active = json.load(f)["active_out"]
        logits = np.asarray(lv.lm_head(params, out.h[:, r0:r1], cfg))[0]
        used["logits"] = _budget_used(logits[:, active], np.load(os.path.join(folder, case["logits_file"])))
        final = np.asarray(llada.rms_norm(out.h[:, r0:r1], params["ln_f"], cfg.rms_norm_eps))[0]
        used["final hidden"] = _budget_used(final, np.load(os.path.join(folder, case["final_hidden_file"])))
        k_rot = np.asarray(llada.Rope.at(pos, cfg).rotate(out.kv[0][0]))[0][:, r0:r1]
        used["keys"] = _budget_used(k_rot, np.load(os.path.join(folder, case["k_layer0_file"])))
        head = jax.jit(lambda h: (lambda lg: (jnp.argmax(lg, -1), jnp.max(jax.nn.softmax(lg, -1), -1)))(
            lv.lm_head(params, h, cfg)))
        am, mp = zip(*(head(out.h[:, i:i + 128]) for i in range(0, out.h.shape[1], 128)))
        am, mp = np.concatenate([np.asarray(a)[0] for a in am]), np.concatenate([np.asarray(m)[0] for m in mp])
        same = int(np.sum(am == np.asarray(case["argmax_all_rows"])))
        used["max prob"] = _budget_used(mp, np.asarray(case["maxprob_all_rows"]))
        inactive_zero = not np.delete(logits, active, axis=1).any()
        ok = all(u <= 1.0 for u in used.values()) and same == len(am) and inactive_zero
        detail = ", ".join(f"{k} {u:.0%}" for k, u in used.items()) + f" of tolerance; argmax {same}/{len(am)}"
        return CaseResult(name, "pass" if ok else "fail", detail + ("" if inactive_zero else
                                                                    "; inactive logit columns not 0"))
    except (OSError, KeyError, ValueError) as e:
        return CaseResult(name, "fail", f"cannot replay: {e}")


def llada_v_replay(folder: str, cases: list, dcfg, slot: int, force: bool = True):
    """The :class:`~polestar_jax.decode.polestar_v.select.VReplay` of LLaDA-V Polestar cases (one row per case):
    the k-means draws of every pass and (``force``) the final labels and the selected clusters of each case's
    ``decisions`` file."""
    import jax.numpy as jnp

    from polestar_jax.decode.polestar_v.replay import build_replay
    from polestar_jax.decode.polestar_v.state import VConfig

    vc = VConfig.from_decode(dcfg)
    reps = []
    for case in cases:
        stem = re.sub(r"_s\d+$", "", case["name"].replace("/", "_"))
        path = os.path.join(folder, "decisions", stem + ".json.gz")
        try:
            import gzip

            with gzip.open(path, "rt") as f:
                decisions = json.load(f)
        except (OSError, ValueError, EOFError) as e:
            raise PolestarError(f"{path}: cannot read ({e})") from None
        reps.append(build_replay(decisions, vc, vc.window_rows(slot, dcfg.block_length),
                                 dcfg.num_blocks * dcfg.block_length, force, force))
    return type(reps[0])(*(jnp.concatenate(a, axis=0) for a in zip(*reps)))


def own_choice_report(res, row: int) -> str:
    """How often this implementation's own k-means labels and cluster choice differed from the injected ones
    in the refreshes of ``row`` (decoder ``polestar_v``)."""
    n = clusters = labels = 0
    for st in res.steps or []:
        for i in np.nonzero(np.asarray(st.refresh)[:, row])[0]:
            n += 1
            clusters += bool((np.asarray(st.clusters[i, row]) != np.asarray(st.own[i, row])).any())
            labels += int(st.labels_differ[i, row])
    return f"own cluster choice differed in {clusters}/{n} refreshes, own labels in {labels} window rows"


def llada_v_passes(res, row: int, pad: int) -> list[tuple[str, int]]:
    """The passes of ``row`` of a ``polestar_v`` result as the golden ``passes`` name them: ``(kind, first
    position)`` with kind ``block_start``, ``cluster_refresh``, ``prefix_refresh`` or ``decode`` (``pad``: the
    row's left padding in the prompt slot)."""
    out = []
    for blk, st in enumerate(res.steps or []):
        if int(res.block_nfe[row, blk]) == 0:
            continue
        out.append(("block_start", 0))
        for i in np.nonzero(np.asarray(st.active)[:, row])[0]:
            kind = ("cluster_refresh" if st.refresh[i, row] else "prefix_refresh" if st.prefix[i, row]
                    else "decode")
            out.append((kind, int(st.start[i, row]) - pad if kind != "prefix_refresh" else 0))
    return out


def replay_llada_v_folder(folder: str, params, cfg, pad_multiple: int = 16,
                          progress: Callable[[CaseResult], None] = lambda r: None, batch: int = 1,
                          mesh=None) -> list[CaseResult]:
    """Replays a LLaDA-V golden folder: the first-pass cases and every generate case (output ids, NFE, the
    commits of every forward and each block's NFE exactly), ``batch`` cases of one setting at a time; Polestar
    cases take the k-means draws, final labels and cluster selections of their ``decisions`` file."""
    import dataclasses as dc

    from polestar_jax.engine.engine import Engine, prompt_slot
    from polestar_jax.models import llada_v as lv

    data = _read_json(os.path.join(folder, "cases.json"))
    results: list[CaseResult] = []

    def add(r: CaseResult):
        results.append(r)
        progress(r)

    rows_of: dict = {}

    def image_rows(rel: str):  # (each picture through the engine's own tower once)
        if rel not in rows_of:
            rows_of[rel] = lv.encode_image(params, os.path.join(folder, rel), cfg)
        return rows_of[rel]

    for tag, case in (data.get("logits_cases") or {}).items():
        add(_llada_v_logits_case(folder, tag, case, params, cfg, image_rows(f"images/{tag}.png")))

    gen_cases = data.get("generate_cases", [])
    groups: dict = {}
    for case in gen_cases:
        try:
            groups.setdefault(llada_v_decode_config(case), []).append(case)
        except PolestarError as e:
            add(CaseResult(case.get("name", "?"), "fail", f"cannot replay: {e}"))
    engine = Engine(params, cfg, mesh=mesh)  # each case's image rows through the engine's own image table

    def local(case):  # (the case's ids with its image's rows named E + j, those rows)
        (ids,), with_rows = lv.with_image_rows({"wte": params["wte"]}, [case["input_ids"]],
                                               [[image_rows(case["image"])]], cfg)
        return ids, with_rows["image_rows"]

    for dcfg, cases in groups.items():
        for i in range(0, len(cases), batch):
            chunk = cases[i:i + batch]
            try:
                prompts, images = map(list, zip(*(local(c) for c in chunk)))
                slot = prompt_slot([len(p) for p in prompts], pad_multiple)
                replay_in = llada_v_replay(folder, chunk, dcfg, slot) if dcfg.decoder == "polestar_v" else None
                res = engine.run(prompts, _reference(dcfg), prompt_slot=slot, replay=replay_in, images=images)
            except PolestarError as e:
                for case in chunk:
                    add(CaseResult(case.get("name", "?"), "fail", f"cannot replay: {e}"))
                continue
            for r, case in enumerate(chunk):
                traj = [[tuple(c) for c in step["commits"]] for step in case.get("trajectory", [])]
                got = _check_generation(case.get("name", "?"), res, r, len(prompts[r]), case["generated_ids"],
                                        case["nfe"], traj, None, [b["block_nfe"] for b in case["block_stats"]],
                                        exact_trajectory=True)
                if dcfg.decoder == "polestar_v":
                    want = [(p["kind"], int(p["start"])) for p in case.get("passes", [])]
                    ours = llada_v_passes(res, r, slot - len(prompts[r]))
                    notes = [got.detail] if got.detail else []
                    if ours != want:
                        f = next(j for j, (a, b) in enumerate(zip(ours + [None] * len(want), want + [None] * len(ours)))
                                 if a != b)
                        notes.append(f"pass {f}: ours {ours[f] if f < len(ours) else None} vs reference "
                                     f"{want[f] if f < len(want) else None}")
                    got = dc.replace(got, status="fail" if ours != want else got.status,
                                     detail="; ".join(notes + [own_choice_report(res, r)]))
                add(got)
    return results


# ------------------------------------------------------------------------------------------------- CLI
def detect_format(folder: str) -> str:
    from polestar_jax.cli import need_folder

    need_folder(folder, "golden folder")
    if os.path.isfile(os.path.join(folder, "cases.json")):
        return {"llava_llada": "llada_v", "Dream": "dream"}.get(_model_type(folder), "llada")
    if polestar_run_files(folder):
        return "polestar"
    raise PolestarError(f"{folder}: neither cases.json nor Polestar run files (*_<method>_g*_b*_s*.json)")


def replay(folder: str, pad_multiple: int = 16, progress=lambda r: None, batch: int = 1,
           mesh=None, kernels: str = "auto") -> list[CaseResult]:
    """Loads the model of ``folder`` and replays everything in it (float32, highest matmul precision),
    ``batch`` cases at a time."""
    import jax

    from polestar_jax.io.checkpoint import load_model

    jax.config.update("jax_default_matmul_precision", "highest")
    kind = detect_format(folder)
    if kind == "llada_v":
        import tempfile

        with tempfile.TemporaryDirectory() as scratch:
            cfg, params = load_model(llada_v_model_folder(folder, scratch), dtype="float32")
        return replay_llada_v_folder(folder, params, cfg, pad_multiple, progress, batch, mesh)
    # a Polestar folder only generates: with a mesh, each process loads just its shards; the other formats'
    # logits cases run unsharded forwards on each process's first device, so they load the whole model
    cfg, params = load_model(folder, dtype="float32", shardings=mesh if kind == "polestar" else None,
                             config=golden_model_config(folder) if kind == "llada" else None)
    if kind == "llada":
        return replay_llada_folder(folder, params, cfg, pad_multiple, progress, batch, mesh)
    if kind == "dream":
        return replay_dream_folder(folder, params, cfg, pad_multiple, progress, batch, mesh, kernels)
    return replay_polestar_folder(folder, params, cfg, pad_multiple, progress, batch, mesh, kernels)


def run(argv: Optional[Sequence[str]] = None) -> int:
    from polestar_jax import cli
    from polestar_jax.config import KERNELS

    ap = cli.Parser(prog="python -m polestar_jax.crosscheck", description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="+", metavar="DIR", help="folders in the golden format")
    ap.add_argument("--pad-multiple", type=int, default=16,
                    help="left-pad prompts to a multiple of this (exercises the key mask; 1 = no padding)")
    ap.add_argument("--batch", type=int, default=1, help="replay this many cases at a time (mixed lengths)")
    ap.add_argument("--mesh", default=None, help="shard over a device mesh, e.g. data=2,model=4 (with several "
                                                 "processes: over all their devices)")
    cli.add_distributed_flags(ap)
    ap.add_argument("--kernels", default="auto", choices=list(KERNELS),
                    help="Polestar's drift/refresh kernels (interpret: the Pallas kernels in the interpreter)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case, not only failures")
    args = ap.parse_args(argv)
    if args.pad_multiple < 1:
        ap.error("--pad-multiple must be >= 1")
    if args.batch < 1:
        ap.error("--batch must be >= 1")
    from polestar_jax import sharding

    cli.join_from_args(args)  # before anything uses a device
    mesh = sharding.mesh_or_none(args.mesh)
    # every process replays (and gets the same verdicts, so the same exit status); process 0 prints
    say = print if sharding.is_leader() else (lambda *a, **k: None)

    def show(r: CaseResult):
        if r.status == "fail" or args.verbose or "cluster choice differed" in r.detail:
            say(f"{r.status.upper():4s} {r.name}" + (f": {r.detail}" if r.detail else ""), flush=True)

    all_results: list[CaseResult] = []
    for folder in args.folders:
        detect_format(folder)
    for folder in args.folders:
        say(f"# {folder}", flush=True)
        res = replay(folder, args.pad_multiple, show, args.batch, mesh, args.kernels)
        skipped = [r for r in res if r.status == "skip"]
        if skipped and not args.verbose:
            reasons = sorted({r.detail for r in skipped})
            say(f"  {len(skipped)} skipped: {'; '.join(reasons)}")
        all_results += res
    n_pass = sum(r.status == "pass" for r in all_results)
    n_fail = sum(r.status == "fail" for r in all_results)
    n_skip = sum(r.status == "skip" for r in all_results)
    say(f"{n_pass} passed, {n_fail} failed" + (f", {n_skip} skipped" if n_skip else ""))
    return 1 if n_fail else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    from polestar_jax import cli

    return cli.run_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
