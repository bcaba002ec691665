"""An lm-evaluation-harness model over the polestar-jax engine, registered as ``polestar-jax``.

Needs the ``[eval]`` extra (``pip install -e '.[eval]'``: lm-eval 0.4.x, no torch). Importing this module
registers the class; ``python -m polestar_jax.eval`` is the command line over it, and from Python::

    import lm_eval
    import polestar_jax.lm_eval_model  # noqa: F401  (registers "polestar-jax")

    lm_eval.simple_evaluate(model="polestar-jax", model_args="model=/models/llada8b-jax,gen_length=256",
                            tasks=["gsm8k"], apply_chat_template=True, fewshot_as_multiturn=False)

``model_args`` (``key=value`` pairs, see :data:`MODEL_ARGS`): ``model`` (a folder; default the bundled
``tiny_tasks``), every :class:`~polestar_jax.config.DecodeConfig` field but ``polestar`` (``decoder``,
``cache``, ``gen_length``, ``block_length``, ``threshold``, ...) and every
:class:`~polestar_jax.config.PolestarConfig` field (``top_k``, ``early_threshold``, ...; all of them in
``docs/configuration.md``), ``batch_size``, ``dtype``, ``mesh`` (axes separated by ``;`` because ``,``
separates the arguments: ``mesh=data=2;model=4``), ``seed``, ``pad_multiple``, ``apply_until``, and for
log-likelihoods ``mc_num``, ``mc_batch``, ``cfg``, ``check_greedy``. A bad value is a one-line
:class:`PolestarError`.

generate_until
    Request ``i`` of a task (its position in lm-eval's document order, ``doc_id * repeats + repeat``) is row
    ``i`` of the job, keyed by ``(seed, i)`` exactly as the ``i``-th prompt of ``generate --prompts-file``.
    Requests are grouped by task, generation length and padded prompt length (multiples of
    ``pad_multiple``), and each group decodes as one continuous job of ``min(batch_size, group size)`` rows
    at once (a finished row's slot takes the group's next request at the next block boundary; a row stops
    after the first finished block that holds a stop token unless ``early_exit=false``), so one executable
    serves a group. ``max_gen_toks`` maps to
    the generation length ``block_length * ceil(max_gen_toks / block_length)`` (the smallest multiple of the
    block length that holds it) unless ``gen_length`` is given, which then serves every request (the
    paper's protocol: gen 256 or 512 whatever the task asks). The prompt is the context lm-eval built
    (rendered with our chat template when lm-eval's ``apply_chat_template`` is on, as it is) encoded
    without added special tokens. The response is cut at the first end-of-text id (EOS, pad, the chat
    end-of-turn ``<|eot_id|>`` / ``<|im_end|>``), decoded without special tokens, then cut at the first of
    the task's ``until`` strings (``apply_until=false`` keeps the whole response).

loglikelihood
    LLaDA's Monte-Carlo estimate of ``log p(continuation | context)`` (the LLaDA paper's evaluation,
    ML-GSAI/LLaDA ``eval_llada.py``): ``mc_num`` (128) masked copies of the sequence, ``mc_batch`` (32) per
    forward; a batch of ``m`` copies masks ``l_j`` of the ``T`` continuation tokens, ``l_j`` evenly spaced
    over ``1..T`` from a uniform random start (a stratified draw of the masking ratio), at uniformly random
    positions; each copy contributes ``(T / l_j) * sum of -log p(token)`` over its masked tokens, and the
    estimate is minus the mean over all copies. ``cfg > 0`` adds unsupervised classifier-free guidance
    (logits ``u + (cfg + 1)(c - u)``, ``u`` with the context masked). ``check_greedy=true`` also decodes the
    continuation one token per forward (most confident first) and reports whether it reproduces it
    (LLaDA's default is on; its authors recommend off, as here: the flag is then False). Draws come from
    ``(seed, i)`` for request ``i`` of a task. The logits are the model family's (a Dream model predicts
    position ``p`` from row ``p-1``). ``loglikelihood_rolling`` (perplexity) is not supported.

Accounting (:meth:`PolestarLM.accounting`), per request and in total, counted as ``bench.run`` counts it:
NFE, non-EOS generated tokens, decode seconds (a batch's seconds shared equally by its real requests; compile
time apart), so ``tpf = non_eos_tokens / nfe`` and ``tps = non_eos_tokens / decode_seconds``. Also
``until_tokens``: the tokens the official Polestar/LLaDA harness counts (the generated text with special
tokens, cut at the ``until`` strings, re-encoded, EOS ids not counted) and ``tpf_until`` from it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import typing
from collections import defaultdict
from typing import Any, Optional, Sequence, Union

import numpy as np

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from polestar_jax import api
from polestar_jax.config import DecodeConfig, PolestarConfig
from polestar_jax.engine.engine import PAD_MULTIPLE, prompt_slot
from polestar_jax.errors import PolestarError

__all__ = ["MODEL_NAME", "MODEL_ARGS", "PolestarLM", "parse_model_args", "gen_length_for", "apply_until"]

MODEL_NAME = "polestar-jax"
log = logging.getLogger("polestar_jax.lm_eval")

# ------------------------------------------------------------------------------------------ model_args

#: model_args that are not decoder knobs: name -> (type, default, help)
_OWN_ARGS: dict[str, tuple[Any, Any, str]] = {
    "model": (str, None, "model folder (HF or converted); default: the bundled tiny_tasks model"),
    "batch_size": (int, 1, "rows per decode batch (the paper's protocol: 1)"),
    "dtype": (str, None, "cast the weights: float32 or bfloat16 (default: as stored)"),
    "weights": (str, "float", "float or int8: matmul weights stored as int8 with a scale per output channel"),
    "mesh": (str, None, "device mesh, axes separated by ';' (data=2;model=4)"),
    "seed": (int, 0, "job seed: request i of a task draws from (seed, i)"),
    "pad_multiple": (int, 16, "prompts are left-padded to a multiple of this (one executable per length bucket)"),
    "apply_until": (bool, True, "cut responses at the task's until strings"),
    "mc_num": (int, 128, "log-likelihood: Monte-Carlo samples per request"),
    "mc_batch": (int, 32, "log-likelihood: Monte-Carlo samples per forward (divides mc_num)"),
    "cfg": (float, 0.0, "log-likelihood: unsupervised classifier-free guidance scale"),
    "check_greedy": (bool, False, "log-likelihood: also check whether greedy decoding reproduces the continuation"),
    "progress": (bool, True, "show a progress bar with running tokens/s"),
}
_ALIASES = {"pretrained": "model", "model_path": "model"}
#: arguments lm-eval passes to every model (simple_evaluate's batch_size/max_batch_size/device); accepted,
#: and ignored where they do not apply
_IGNORED = ("max_batch_size", "device")


def _knob_types() -> dict[str, Any]:
    out = {}
    for cls in (DecodeConfig, PolestarConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "polestar":
                continue
            out[f.name] = hints[f.name]
            for alias in (f.metadata.get("flag"), *f.metadata.get("aliases", ())):
                if alias:
                    _ALIASES.setdefault(alias.lstrip("-").replace("-", "_"), f.name)
    return out


_KNOB_TYPES = _knob_types()
#: Every accepted model_args key (aliases apart).
MODEL_ARGS = tuple(_OWN_ARGS) + tuple(_KNOB_TYPES)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """``value`` (as lm-eval parsed it: bool, int, float, None or str) as type ``tp``; one-line error else."""
    optional = typing.get_origin(tp) is Union and type(None) in typing.get_args(tp)
    if optional:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if isinstance(tp, type) and issubclass(tp, str) and tp is not str:  # a mode (str enum): the config checks it
        tp = str
    if tp is str and key in _KNOB_TYPES:  # cache=none, offload_hidden=none: the string (lm-eval reads None)
        return "none" if value is None else str(value)
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        if optional or key in ("model", "dtype", "mesh", "gen_length", "block_length", "steps"):
            return None
        raise PolestarError(f"model_args: {key}=none is not allowed")
    bad = PolestarError(f"model_args: {key}={value!r} is not {api.type_word(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in ("true", "1", "yes", "on"):
            return True
        if s in ("false", "0", "no", "off"):
            return False
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        try:
            f = float(str(value))
        except ValueError:
            raise bad from None
        if not f.is_integer():
            raise bad
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise bad
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad from None
    return str(value)


def parse_model_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits and type-checks model_args into (own settings with defaults, decoder knobs given)."""
    own = {k: v[1] for k, v in _OWN_ARGS.items()}
    knobs: dict[str, Any] = {}
    for raw, value in args.items():
        key = _ALIASES.get(raw, raw)
        if key in _IGNORED:
            continue
        if key in _OWN_ARGS:
            if key == "batch_size" and isinstance(value, str) and value.startswith("auto"):
                raise PolestarError("model_args: batch_size=auto is not supported (give a number)")
            own[key] = _coerce(key, value, _OWN_ARGS[key][0]) if value is not None else own[key]
        elif key in _KNOB_TYPES:
            knobs[key] = _coerce(key, value, _KNOB_TYPES[key])
        else:
            raise PolestarError(f"model_args: unknown argument {raw!r} (known: {', '.join(MODEL_ARGS)})")
    for key in ("batch_size", "pad_multiple", "mc_num", "mc_batch"):
        if own[key] < 1:
            raise PolestarError(f"model_args: {key} must be >= 1, got {own[key]}")
    if own["mc_num"] % own["mc_batch"]:
        raise PolestarError(f"model_args: mc_batch {own['mc_batch']} does not divide mc_num {own['mc_num']}")
    if own["cfg"] < 0:
        raise PolestarError(f"model_args: cfg must be >= 0, got {own['cfg']}")
    if own["mesh"]:
        own["mesh"] = own["mesh"].replace(";", ",")
    for key in ("gen_length", "block_length", "steps"):
        if knobs.get(key, 0) is None:
            del knobs[key]
    return own, knobs


def gen_length_for(max_gen_toks: int, block_length: int) -> int:
    """The generation length of a request asking for ``max_gen_toks`` tokens: the smallest multiple of the
    block length that holds them (at least one block)."""
    return block_length * max(1, math.ceil(int(max_gen_toks) / block_length))


def apply_until(text: str, until: Sequence[str]) -> str:
    """``text`` cut at the earliest occurrence of any of the (non-empty) stop strings ``until``."""
    cut = len(text)
    for s in until or ():
        if s:
            i = text.find(s)
            if 0 <= i < cut:
                cut = i
    return text[:cut]


# ------------------------------------------------------------------------------------------ the model

@register_model(MODEL_NAME)
class PolestarLM(LM):
    """lm-eval model ``polestar-jax`` (see the module docstring for ``model_args``)."""

    def __init__(self, model_obj: Optional[api.Model] = None, **model_args: Any):
        super().__init__()
        self.own, self.knobs = parse_model_args(model_args)
        self.model_args = dict(model_args)
        self.model = model_obj if model_obj is not None else api.Model(
            self.own["model"], dtype=self.own["dtype"], mesh=self.own["mesh"], weights=self.own["weights"])
        self.tokenizer = self.model.tokenizer
        self.batch_size = self.own["batch_size"]
        self.seed = self.own["seed"]
        self.apply_until = self.own["apply_until"]
        self.progress = self.own["progress"]
        # every knob checked once, before any request: a config at a representative length
        self.fixed_gen_length = self.knobs.get("gen_length")
        if "steps" in self.knobs and self.fixed_gen_length is None:
            raise PolestarError("model_args: steps needs gen_length (the gen length otherwise follows each "
                                "task's max_gen_toks)")
        probe = self.decode_config(self.fixed_gen_length)
        self.block_length = probe.block_length
        self.records: list[dict] = []  # one per generate_until request, in decode order
        self.batches: list[dict] = []
        self._indexed = 0  # records in _index (task, doc_id) -> records
        self._index: dict = {}
        self.ll_records: list[dict] = []
        self._programs: dict = {}  # (function name, guided) -> its jitted program (log-likelihoods)

    # -------------------------------------------------------------------------- configs and identity
    def decode_config(self, gen_length: Optional[int]) -> DecodeConfig:
        """The decoder of a request group of ``gen_length`` tokens (None: the model folder's default)."""
        knobs = dict(self.knobs)
        if gen_length is not None:
            knobs["gen_length"] = gen_length
        try:
            return self.model.decode_config(**knobs)
        except PolestarError as e:
            raise PolestarError(f"model_args: {e}") from None

    def gen_length(self, gen_kwargs: dict) -> int:
        """The generation length of a request (see :func:`gen_length_for`)."""
        if self.fixed_gen_length is not None:
            return self.fixed_gen_length
        block = self.knobs.get("block_length") or self.model.defaults.get("block_length", 32)
        return gen_length_for(gen_kwargs.get("max_gen_toks", self.max_gen_toks), block)

    @property
    def max_gen_toks(self) -> int:
        return 256  # lm-eval's default when a task sets none

    @property
    def max_length(self) -> int:
        return self.model.config.max_sequence_length

    @property
    def eot_token_id(self) -> int:
        return self.model.config.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.model.path.replace("/", "__")

    def chat_template(self, chat_template: Union[bool, str] = False) -> Optional[str]:
        return getattr(self.tokenizer, "chat_template", None) or None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval's chat hook: our tokenizer's template. Without a generation prompt (a task with a
        ``gen_prefix``) the rendering stops right after the last message's text, so the model continues it."""
        text = self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)
        if not add_generation_prompt and chat_history:
            last = str(chat_history[-1].get("content", "")).strip()
            i = text.rfind(last) if last else -1
            if i >= 0:
                text = text[: i + len(last)]
        return text

    def get_model_info(self) -> dict:
        return {"model_name": self.model.path, "model_dtype": self.own["dtype"] or "as stored",
                "model_weights": self.own["weights"],
                "polestar_jax_decoder": dataclasses.asdict(self.decode_config(self.fixed_gen_length))}

    # -------------------------------------------------------------------------- rows
    @staticmethod
    def _rows(requests: Sequence[Any]) -> list[int]:
        """Each request's row in its task: ``doc_id * repeats + k`` for its k-th copy (lm-eval passes a
        request ``repeats`` times in a row), else its position among the task's requests."""
        seen: dict[int, int] = defaultdict(int)
        counter: dict[Any, int] = defaultdict(int)
        out = []
        for req in requests:
            task = getattr(req, "task_name", None)
            doc = getattr(req, "doc_id", None)
            reps = getattr(req, "repeats", None) or 1
            k = seen[id(req)]
            seen[id(req)] += 1
            out.append(doc * reps + k if isinstance(doc, int) else counter[task])
            counter[task] += 1
        return out

    # -------------------------------------------------------------------------- generate_until
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        tok, cfg = self.tokenizer, self.model.config
        rows = self._rows(requests)
        groups: dict[tuple, list[int]] = defaultdict(list)
        prompts, gens = [], []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args[0], dict(req.args[1] or {})
            ids = tok.encode(context)
            if not ids:
                raise PolestarError(f"{req.task_name} request {rows[i]}: empty prompt")
            G = self.gen_length(gen_kwargs)
            if len(ids) + G > cfg.max_sequence_length:
                raise PolestarError(f"{req.task_name} request {rows[i]}: prompt of {len(ids)} tokens + gen length "
                                    f"{G} exceeds the model's max_sequence_length {cfg.max_sequence_length}")
            if gen_kwargs.get("do_sample") and float(gen_kwargs.get("temperature", 0) or 0) > 0 and \
                    "temperature" not in self.knobs:
                log.warning("%s asks for sampling; polestar-jax decodes with model_args temperature (default "
                            "0, greedy)", req.task_name)
            slot = prompt_slot([len(ids)], self.own["pad_multiple"])
            groups[(req.task_name, G, slot)].append(i)
            prompts.append(ids)
            gens.append(gen_kwargs)
        out: list[Optional[str]] = [None] * len(requests)
        bar = self._bar(len(requests), disable_tqdm)
        tokens_done, nfe_done, seconds_done = 0, 0, 0.0
        for (task, G, slot), members in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2])):
            members.sort(key=lambda i: rows[i])
            dcfg = self.decode_config(G)
            b = min(self.batch_size, len(members))
            # one continuous job per group: b rows decode at once, a finished row's slot takes the next request
            res = self.model.generate_ids([prompts[i] for i in members], dcfg, seed=self.seed,
                                          rows=[rows[i] for i in members], prompt_slot=slot, batch_size=b)
            share = res.seconds / len(members)
            batch_id = len(self.batches)
            self.batches.append({"task": task, "gen_length": G, "prompt_slot": slot, "rows": b,
                                 "real_rows": len(members), "decode_seconds": res.seconds,
                                 "compile_seconds": res.compile_seconds})
            for j, i in enumerate(members):
                g = res[j]
                until = list(gens[i].get("until") or [])
                if isinstance(gens[i].get("until"), str):
                    until = [gens[i]["until"]]
                text = apply_until(g.text, until) if self.apply_until else g.text
                full = tok.decode(g.token_ids, skip_special_tokens=False)
                kept = apply_until(full, until) if self.apply_until else full
                until_tokens = sum(1 for t in tok.encode(kept) if t not in self.model.eos_ids)
                out[i] = text
                self.records.append({
                    "task": task, "doc_id": getattr(requests[i], "doc_id", None), "row": rows[i],
                    "batch": batch_id, "gen_length": G, "block_length": dcfg.block_length,
                    "prompt_tokens": len(prompts[i]), "nfe": g.nfe, "non_eos_tokens": g.non_eos_tokens,
                    "until_tokens": until_tokens, "tpf": g.tpf, "decode_seconds": share,
                    "compile_seconds": res.compile_seconds / len(members), **g.stats})
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            tokens_done += res.non_eos_tokens
            nfe_done += res.nfe
            seconds_done += res.seconds
            if bar is not None:
                bar.set_postfix_str(f"{tokens_done / seconds_done if seconds_done > 0 else 0.0:.1f} tok/s, "
                                    f"tpf {tokens_done / max(1, nfe_done):.2f}", refresh=False)
                bar.update(len(members))
        if bar is not None:
            bar.close()
        return out  # type: ignore[return-value]

    def _bar(self, total: int, disable: bool):
        if not self.progress or disable:
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc=MODEL_NAME, unit="req", dynamic_ncols=True)

    # -------------------------------------------------------------------------- accounting
    def accounting(self) -> dict:
        """Per task and in total: requests, nfe, non_eos_tokens, until_tokens, decode_seconds,
        compile_seconds, tpf, tpf_until, tps, nfe_per_request (and Polestar's mean refresh steps, early and
        suffix commits per request)."""
        by: dict[str, list[dict]] = defaultdict(list)
        for r in self.records:
            by[r["task"]].append(r)
        compile_by: dict[str, float] = defaultdict(float)
        for b in self.batches:
            compile_by[b["task"]] += b["compile_seconds"]
        tasks = {t: _summary(rs, compile_by[t]) for t, rs in sorted(by.items())}
        total = _summary(self.records, sum(compile_by.values()))
        return {"tasks": tasks, "total": total, "batches": len(self.batches),
                "loglikelihood_requests": len(self.ll_records),
                "loglikelihood_forwards": sum(r["forwards"] for r in self.ll_records),
                "loglikelihood_seconds": sum(r["seconds"] for r in self.ll_records)}

    def summary(self, records: Sequence[dict]) -> dict:
        """The accounting of some of :attr:`records` (e.g. the subtasks of a group)."""
        batches = {r["batch"] for r in records}
        return _summary(records, sum(b["compile_seconds"] for i, b in enumerate(self.batches) if i in batches))

    def request_records(self, task: str, doc_id: int) -> list[dict]:
        """The accounting of the requests of document ``doc_id`` of ``task``."""
        if self._indexed != len(self.records):
            self._index = defaultdict(list)
            for r in self.records:
                self._index[(r["task"], r["doc_id"])].append(r)
            self._indexed = len(self.records)
        return list(self._index.get((task, doc_id), []))

    # -------------------------------------------------------------------------- log-likelihoods
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if not requests:
            return []
        rows = self._rows(requests)
        bar = self._bar(len(requests), disable_tqdm)
        out = []
        for i, req in enumerate(requests):
            context, continuation = req.args[0], req.args[1]
            prefix, target = self._encode_pair(context, continuation)
            if not target:
                raise PolestarError(f"{req.task_name} request {rows[i]}: empty continuation")
            n = len(prefix) + len(target)
            if n > self.max_length:
                raise PolestarError(f"{req.task_name} request {rows[i]}: context + continuation of {n} tokens "
                                    f"exceed the model's max_sequence_length {self.max_length}")
            t0 = time.perf_counter()
            ll, forwards = self._mc_loglikelihood(prefix, target, rows[i])
            greedy = False
            if self.own["check_greedy"]:
                greedy = self._greedy_matches(prefix, target)
                forwards += len(target) * (2 if self.own["cfg"] > 0 else 1)
            self.ll_records.append({"task": req.task_name, "row": rows[i], "forwards": forwards,
                                    "seconds": time.perf_counter() - t0})
            out.append((ll, greedy))
            self.cache_hook.add_partial("loglikelihood", req.args, (ll, greedy))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise PolestarError("polestar-jax does not support loglikelihood_rolling (perplexity tasks): a diffusion "
                            "LM has no left-to-right likelihood to roll, and LLaDA's evaluation defines none")

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids as lm-eval splits them: trailing spaces of the context move to the
        continuation; the continuation's ids are those of the whole text after the context's. An empty
        context becomes the BOS token."""
        tok = self.tokenizer
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
        if not context:
            bos = tok.bos_token_id
            if bos is None:
                raise PolestarError("loglikelihood with an empty context needs a BOS token")
            return [bos], tok.encode(continuation)
        whole = tok.encode(context + continuation)
        ctx = tok.encode(context)
        return ctx, whole[len(ctx):]

    def _arrays(self, prefix: Sequence[int], target: Sequence[int], copies: int):
        n = len(prefix) + len(target)
        L = prompt_slot([n], PAD_MULTIPLE)  # (the scored sequence, bucketed as a prompt is)
        ids = np.full((copies, L), self.model.config.pad_token_id, np.int32)
        ids[:, :n] = np.asarray(list(prefix) + list(target), np.int32)
        valid = np.zeros((copies, L), bool)
        valid[:, :n] = True
        return ids, valid

    def _mc_loglikelihood(self, prefix: Sequence[int], target: Sequence[int], row: int) -> tuple[float, int]:
        """Minus the mean over ``mc_num`` masked copies of (T / l) * (masked tokens' negative log-probability)."""
        m, mc = self.own["mc_batch"], self.own["mc_num"]
        T, P = len(target), len(prefix)
        rng = np.random.default_rng([int(self.seed), int(row)])
        ids, valid = self._arrays(prefix, target, m)
        tgt = ids.copy()
        mask_id = self.model.config.mask_token_id
        fn = self._program(_nll)
        total, forwards = 0.0, 0
        for _ in range(mc // m):
            k = int(rng.integers(1, T + 1))
            counts = np.round(np.linspace(k, k + (m - 1) * T / m, m)).astype(np.int64)
            counts = (counts - 1) % T + 1
            noisy = ids.copy()
            weights = np.zeros(ids.shape, np.float32)
            for j in range(m):
                pos = P + rng.permutation(T)[: counts[j]]
                noisy[j, pos] = mask_id
                weights[j, pos] = T / counts[j]
            uncond = noisy.copy()
            uncond[:, :P] = mask_id
            nll = np.asarray(fn(self.model.params, noisy, uncond, valid, tgt, np.float32(self.own["cfg"])))
            total += float(np.sum(nll * weights))
            forwards += 2 if self.own["cfg"] > 0 else 1
        return -total / mc, forwards

    def _program(self, fn):
        """``fn`` (:func:`_nll` or :func:`_argmax`) jitted for this model and guidance setting, kept by this
        instance (compiled on first use; dropped with it)."""
        key = (fn.__name__, self.own["cfg"] > 0)
        if key not in self._programs:
            import jax

            self._programs[key] = jax.jit(functools.partial(fn, mcfg=self.model.config, use_cfg=key[1]))
        return self._programs[key]

    def _greedy_matches(self, prefix: Sequence[int], target: Sequence[int]) -> bool:
        """Whether decoding the continuation one token per forward (the most confident masked position
        first) reproduces it."""
        T, P = len(target), len(prefix)
        mask_id = self.model.config.mask_token_id
        ids, valid = self._arrays(prefix, [mask_id] * T, 1)
        fn = self._program(_argmax)
        for _ in range(T):
            uncond = ids.copy()
            uncond[:, :P] = mask_id
            best, conf = (np.asarray(a) for a in fn(self.model.params, ids, uncond, valid,
                                                    np.float32(self.own["cfg"])))
            masked = np.nonzero(ids[0, :P + T] == mask_id)[0]
            j = masked[np.argmax(conf[0, masked])]
            ids[0, j] = best[0, j]
        return bool(np.array_equal(ids[0, P:P + T], np.asarray(target)))


def _summary(records: Sequence[dict], compile_seconds: float) -> dict:
    n = len(records)
    nfe = sum(r["nfe"] for r in records)
    tokens = sum(r["non_eos_tokens"] for r in records)
    until = sum(r["until_tokens"] for r in records)
    seconds = sum(r["decode_seconds"] for r in records)
    out = {"requests": n, "nfe": nfe, "non_eos_tokens": tokens, "until_tokens": until, "decode_seconds": seconds,
           "compile_seconds": compile_seconds, "tpf": tokens / max(1, nfe), "tpf_until": until / max(1, nfe),
           "tps": tokens / seconds if seconds > 0 else 0.0, "nfe_per_request": nfe / n if n else 0.0,
           "gen_lengths": sorted({r["gen_length"] for r in records})}
    for key in ("refresh_steps", "early_commits", "suffix_commits"):
        if any(key in r for r in records):
            out[f"{key}_per_request"] = sum(r.get(key, 0) for r in records) / max(1, n)
    return out


def _guided_logits(params, noisy, uncond, valid, scale, mcfg, use_cfg: bool):
    """Logits predicting every position (the model family's forward and logit alignment: Dream predicts
    position p from row p-1), with unsupervised classifier-free guidance when ``use_cfg``."""
    from polestar_jax.models.family import family_of

    fam = family_of(mcfg)
    logits = fam.logits(params, noisy, mcfg, key_valid=valid)
    if use_cfg:
        un = fam.logits(params, uncond, mcfg, key_valid=valid)
        logits = un + (scale + 1.0) * (logits - un)
    return logits


def _nll(params, noisy, uncond, valid, targets, scale, *, mcfg, use_cfg: bool):
    """Each position's negative log-probability of ``targets`` [m, L] under the (guided) logits."""
    import jax
    import jax.numpy as jnp

    logits = _guided_logits(params, noisy, uncond, valid, scale, mcfg, use_cfg)  # [m, L, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [m, L]


def _argmax(params, ids, uncond, valid, scale, *, mcfg, use_cfg: bool):
    """Each position's most likely token and its probability (the greedy check's step)."""
    import jax
    import jax.numpy as jnp

    logits = _guided_logits(params, ids, uncond, valid, scale, mcfg, use_cfg).astype(jnp.float32)  # [1, L, V]
    return jnp.argmax(logits, axis=-1), jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)  # [1, L], [1, L]
