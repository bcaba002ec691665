"""Decoder benchmark: LLaDA vs Fast-dLLM (cache none / prefix / dual) on a random model, on this machine.

Runs, in ONE process, every decoder on a seeded random LLaDA-architecture model and reports per decoder
the NFE (forwards), TPF (generated tokens per forward), tokens/s of the decode loop (compile excluded, as
``Engine.run`` measures it) and the compile time; then the cost of one forward of each kind
(full sequence, prefix-cache step, dual-cache step): median milliseconds of a jitted single forward and
its FLOPs from XLA's cost analysis.

Two model variants are decoded:

* ``random``: :func:`polestar_jax.models.llada.init_params` as is. Its predictions are nearly uniform over the
  vocabulary, so with threshold 0.9 Fast-dLLM commits one token per forward (the forced most-confident one).
* ``peaked``: the same parameters with the LM head multiplied by ``peak_scale`` and the mask token's
  embedding row set to zero. Scaling the head alone makes every masked position of a block almost equally
  confident (their hidden state is dominated by the shared mask embedding), so the threshold rule flips
  between "one token per forward" and "the whole block at once"; with a zero mask embedding a masked
  position's prediction comes from its context (attention + RoPE) and confidences spread, so the threshold
  commits a varying number of tokens per forward. It is still a random model: only the *speed* numbers
  mean anything, never the tokens.

``--family dream`` runs the same on a random Dream-architecture model (Qwen2 layout: q/k/v biases, 8 query
heads sharing 2 KV heads, RoPE theta 1e6, the family's logit shift) with Dream's samplers as the official
Dream code runs them (``docs/algorithm.md#dream``): the no-cache threshold sampler, the dual-cache loop with
the threshold rule and with the neg-entropy fixed schedule, and Polestar with the family's parameters.

Usage::

    python -m bench.bench_decoders [--quick] [--out DIR]

Writes ``DIR/bench_decoders.json`` (default ``bench/results/``) and prints markdown tables.
Timings are wall-clock on whatever machine runs this (possibly shared with other work): compare rows of
one run, not runs of different machines.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import RESULTS_DIR
from polestar_jax.models import llada as M
from polestar_jax.models import dream as MD
from polestar_jax.config import DecodeConfig, ModelConfig
from polestar_jax.engine.engine import Engine
from polestar_jax.decode.block import EngineSpec
from polestar_jax.models.family import polestar_config_for
from polestar_jax.decode.samplers import cached_forward, full_forward
from polestar_jax.decode.layout import init_decode_state

DEFAULT_OUT = RESULTS_DIR

#: (decoder, cache, threshold) in report order.
DECODERS: tuple[tuple[str, str, Optional[float]], ...] = (
    ("llada", "none", None),
    ("fastdllm", "none", 0.9),
    ("fastdllm", "prefix", 0.9),
    ("fastdllm", "dual", 0.9),
    ("polestar", "dual", 0.9),
)
#: Dream's samplers (``--family dream``): (decoder, cache, threshold, label, DecodeConfig options), as
#: ``crosscheck.dream_decode_config`` maps the official settings; Polestar takes the family's parameters.
DREAM_DECODERS: tuple[tuple[str, str, Optional[float], str, dict], ...] = (
    ("fastdllm", "none", 0.9, "dream-threshold", {}),
    ("fastdllm", "dual", 0.9, "dream-dual-threshold", {"step_after_full_pass": False, "start_commit": "first"}),
    ("fastdllm", "dual", None, "dream-dual-entropy", {"step_after_full_pass": False, "start_commit": "first",
                                                      "schedule": "timesteps", "rank_by": "neg_entropy"}),
    ("polestar", "dual", 0.9, "dream-polestar", {}),
)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Everything that defines one benchmark run."""

    name: str = "small"
    family: str = "llada"  # or "dream" (Qwen2 layout with q/k/v biases; DREAM_DECODERS)
    n_layers: int = 8
    d_model: int = 512
    n_heads: int = 8
    n_kv_heads: Optional[int] = None  # default: n_heads (no GQA)
    mlp_hidden: int = 1408
    vocab: int = 32000  # embedding size; mask id = vocab - 1, eos = pad = vocab - 2
    prompt_length: int = 64
    gen_length: int = 256
    block_length: int = 32
    steps: int = 256
    threshold: float = 0.9
    seed: int = 0
    peak_scale: float = 60.0  # LM-head factor of the "peaked" variant
    peak_zero_mask_embedding: bool = True
    decode_repeats: int = 1  # timed decodes per row (median); the first one compiles (compile time apart)
    forward_warmup: int = 1
    forward_reps: int = 5
    flops: bool = True
    param_init: str = "init_params"  # or "numpy" (smoke test only, see make_params)

    def model_config(self) -> ModelConfig:
        dream = {"include_qkv_bias": True, "family": "dream", "rope_theta": 1e6, "rms_norm_eps": 1e-6}
        cfg = ModelConfig(d_model=self.d_model, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads or self.n_heads,
                          n_layers=self.n_layers, mlp_hidden_size=self.mlp_hidden, vocab_size=self.vocab,
                          embedding_size=self.vocab, mask_token_id=self.vocab - 1, eos_token_id=self.vocab - 2,
                          pad_token_id=self.vocab - 2,
                          max_sequence_length=max(4096, self.prompt_length + self.gen_length),
                          **(dream if self.family == "dream" else {}))
        cfg.validate(self.name)
        return cfg

    def decoders(self) -> tuple[tuple[str, str, Optional[float], str, dict], ...]:
        """The decoder rows of this family: (decoder, cache, threshold, label, DecodeConfig options)."""
        if self.family == "dream":
            return DREAM_DECODERS
        return tuple((d, c, t, d, {}) for d, c, t in DECODERS)


SMALL = BenchConfig()
#: ``--quick``: a smoke-check size (2 layers, d_model 128, gen 64). The head factor is doubled so that the
#: logit spread matches the small model's (logit std ~ factor * 0.02 * sqrt(d_model)).
QUICK = dataclasses.replace(SMALL, name="quick", n_layers=2, d_model=128, n_heads=4, mlp_hidden=352,
                            prompt_length=32, gen_length=64, steps=64, peak_scale=120.0, forward_reps=3)
#: ``--family dream``: the same sizes as a Dream-architecture model, 4 query heads per KV head.
DREAM_SMALL = dataclasses.replace(SMALL, name="dream-small", family="dream", n_kv_heads=2)
DREAM_QUICK = dataclasses.replace(QUICK, name="dream-quick", family="dream", n_kv_heads=1)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- models


def make_params(bc: BenchConfig, cfg: ModelConfig) -> dict[str, Any]:
    """``{"random": params, "peaked": params}`` (float32, seeded).

    ``bc.param_init == "init_params"``: :func:`polestar_jax.models.llada.init_params` (the benchmark's model).
    ``"numpy"``: the same layout and scales drawn with NumPy, for the smoke test only (compiling the
    threefry draws of ``init_params`` costs seconds of CPU, more than a tiny model's whole decode).
    """

    key = jax.random.PRNGKey(bc.seed)
    init = MD.init_params if cfg.family == "dream" else M.init_params  # Dream: with q/k/v biases
    if bc.param_init == "init_params":
        # eager, exactly ``init_params(cfg, PRNGKey(seed))`` (a jitted init differs in the last bits)
        params = jax.tree.map(np.asarray, init(cfg, key, dtype=jnp.float32))
    elif bc.param_init == "numpy":
        rng = np.random.default_rng(bc.seed)

        def leaf(path, a):
            name = jax.tree_util.keystr(path)
            if "norm" in name or "ln_f" in name:
                return np.ones(a.shape, np.float32)
            std = 1.0 if "wte" in name else 0.02
            return rng.standard_normal(a.shape, dtype=np.float32) * np.float32(std)

        shapes = jax.eval_shape(lambda k: init(cfg, k, dtype=jnp.float32), key)
        params = jax.tree_util.tree_map_with_path(leaf, shapes)
    else:
        raise ValueError(f"unknown param_init {bc.param_init!r}")
    peaked = dict(params)
    peaked["lm_head"] = params["lm_head"] * np.float32(bc.peak_scale)
    if bc.peak_zero_mask_embedding:
        peaked["wte"] = params["wte"].copy()
        peaked["wte"][cfg.mask_token_id] = 0.0
    return {"random": jax.tree.map(jnp.asarray, params), "peaked": jax.tree.map(jnp.asarray, peaked)}


def make_prompt(bc: BenchConfig, cfg: ModelConfig) -> list[int]:
    """``prompt_length`` random token ids (never the mask / eos / pad ids)."""
    rng = np.random.default_rng(bc.seed)
    return rng.integers(0, min(cfg.eos_token_id, cfg.pad_token_id, cfg.mask_token_id),
                        bc.prompt_length).tolist()


# ---------------------------------------------------------------------------------------------- decoders


def decode_config(bc: BenchConfig, decoder: str, cache: str, threshold: Optional[float],
                  options: Optional[dict] = None) -> DecodeConfig:
    """The row's :class:`DecodeConfig` (``options``: further DecodeConfig fields); decoder polestar takes
    the family's Polestar parameters (Dream: its windows, proxy score, K/V patch and tie rule)."""
    return DecodeConfig(decoder=decoder, cache=cache, gen_length=bc.gen_length, block_length=bc.block_length,
                        steps=bc.steps, threshold=threshold, temperature=0.0,
                        polestar=polestar_config_for(bc.family, decoder),
                        **{"early_exit": False, **(options or {})})  # speed per forward: every block decoded


def bench_decoder(params, cfg: ModelConfig, prompt: list[int], bc: BenchConfig, variant: str,
                  decoder: str, cache: str, threshold: Optional[float], label: Optional[str] = None,
                  options: Optional[dict] = None) -> dict:
    """Runs one decoder ``decode_repeats`` times and returns its result row."""
    dcfg = decode_config(bc, decoder, cache, threshold, options)
    runs, compile_s, res = [], 0.0, None
    engine = Engine(params, cfg)  # one compile, then the timed repeats
    for _ in range(max(1, bc.decode_repeats)):
        res = engine.run([prompt], dcfg, seed=bc.seed, prompt_slot=bc.prompt_length)
        compile_s += res.compile_seconds
        runs.append(res.seconds)
    seconds = statistics.median(runs)
    nfe = int(res.nfe[0])
    tokens = res.tokens[0]
    n_gen = int(tokens.size)
    non_eos = int(np.sum((tokens != cfg.eos_token_id) & (tokens != cfg.pad_token_id)))
    return {
        "variant": variant, "decoder": decoder, "cache": cache, "threshold": threshold,
        "label": label or decoder, "options": dict(options or {}),
        "nfe": nfe,
        "tpf": n_gen / nfe,  # all generated positions per forward (every one is committed exactly once)
        "tpf_non_eos": non_eos / nfe,
        "generated_tokens": n_gen,
        "decode_seconds": seconds,
        "decode_seconds_runs": runs,
        "tokens_per_s": n_gen / seconds if seconds > 0 else 0.0,
        "ms_per_forward": 1e3 * seconds / nfe,
        "compile_seconds": compile_s,
        "block_nfe": [int(v) for v in res.block_nfe[0]],
        "max_commits_per_forward": max(res.commits_per_forward(0)),
        "distinct_tokens": int(len(np.unique(tokens))),
        "all_committed": bool(np.all(tokens != cfg.mask_token_id)),
        **({} if res.polestar is None else {
            "refresh_steps": int(res.polestar["refresh_steps"][0].sum()),
            "block_starts": int(res.polestar["processed"][0].sum()),
            "windowed_passes": int(res.polestar["windowed"][0].sum()),
            "early_commits": int(res.polestar["early"][0]),
            "suffix_commits": int(res.polestar["suffix"][0])}),
    }


def gflops_by_kind(forwards: list[dict]) -> dict[str, float]:
    """GFLOP of one forward per kind: XLA's cost analysis, or the matmul formula where XLA gave none."""
    return {f["kind"]: (f["gflops_xla"] if f["gflops_xla"] is not None else f["gflops_matmul_analytic"])
            for f in forwards}


def forwards_gflops(decoder: str, cache: str, nfe: int, starts: int, refresh: int, by: dict[str, float]) -> float:
    """GFLOP of ``nfe`` forwards of a decoder: without a cache every forward is a full pass; otherwise
    ``starts`` block-start full passes (Polestar's windowed passes counted as full ones, an upper bound)
    and the decoder's step kind for the rest (``refresh`` of them Polestar refresh steps)."""
    if cache == "none":
        return nfe * by["full"]
    if decoder == "polestar":
        return (starts * by["full"] + (nfe - starts - refresh) * by["polestar_step"]
                + refresh * by["polestar_refresh_step"])
    return starts * by["full"] + (nfe - starts) * by[f"{cache}_step"]


def gflops_per_token(row: dict, forwards: list[dict], n_blocks: int) -> Optional[float]:
    """FLOPs per generated token of a result row (:func:`forwards_gflops`; Polestar rows count the blocks
    they started, ``block_starts``: a block filled ahead by suffix commits has no start pass)."""
    total = forwards_gflops(row["decoder"], row["cache"], row["nfe"], row.get("block_starts", n_blocks),
                            row.get("refresh_steps", 0), gflops_by_kind(forwards))
    return total / row["generated_tokens"]


# ---------------------------------------------------------------------------------------------- forwards


def cost_flops(compiled) -> Optional[float]:
    """'flops' of a compiled executable's XLA cost analysis (dict, list of dicts or None), or None."""
    try:
        ca = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - cost analysis is best effort on every backend
        return None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    if not isinstance(ca, dict):
        return None
    v = ca.get("flops")
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if v >= 0 else None


def analytic_flops(cfg: ModelConfig, q_rows: int, keys: int, head_rows: int) -> float:
    """Matmul FLOPs (2 per multiply-add) of one forward: projections + MLP + attention + LM head."""
    d, f, hd = cfg.d_model, cfg.mlp_hidden_size, cfg.head_dim
    kvd = cfg.n_kv_heads * hd
    proj = 2 * q_rows * (d * d + 2 * d * kvd + d * d + 3 * d * f)
    attn = 2 * 2 * q_rows * keys * cfg.n_heads * hd
    return cfg.n_layers * (proj + attn) + 2 * head_rows * d * cfg.embedding_size


def forward_kinds(params, cfg: ModelConfig, prompt: list[int], bc: BenchConfig) -> list[tuple]:
    """For each forward kind: (kind, cache, make(unroll) -> fn(params, state, cs) -> block logits, state, cs,
    query rows, key count, description); ``cs`` is the first block's start, the state is the initial decode
    state; ``unroll`` is the layer scans' (True: fully unrolled, for XLA's cost analysis, which counts a
    loop body once)."""
    from polestar_jax.decode.polestar import state as PSt
    from polestar_jax.decode.polestar.step import step_forward

    length = bc.prompt_length + bc.gen_length
    out = []
    for kind, cache in (("full", "none"), ("prefix_step", "prefix"), ("dual_step", "dual")):
        dcfg = decode_config(bc, "fastdllm", cache, bc.threshold)
        state = init_decode_state(cfg, dcfg, [prompt], bc.prompt_length, seed=bc.seed)
        cs = jnp.int32(bc.prompt_length)  # first block
        spec_of = lambda u, dcfg=dcfg: EngineSpec.from_config(cfg, dcfg, unroll=u)
        if cache == "none":
            make = lambda u, spec_of=spec_of: lambda p, s, c: full_forward(p, s, spec_of(u), c, keep_cache=False)[0]
            q_rows, desc = length, f"whole sequence, {length} rows (LM head on the {bc.block_length}-row block)"
        else:
            # the cache holds zeros: a forward has no data-dependent control flow, so its cost does not
            # depend on the cached values (and this saves a compile)
            make = lambda u, spec_of=spec_of: lambda p, s, c: cached_forward(p, s, spec_of(u), c)[0]
            if cache == "prefix":
                q_rows = bc.gen_length
                desc = f"{bc.gen_length} generation rows against the cached prefix ({length} keys)"
            else:
                q_rows = bc.block_length
                desc = f"{bc.block_length}-row block against cached prefix+suffix ({length} keys)"
        out.append((kind, cache, make, state, cs, q_rows, length, desc))
    # Polestar's decode step without and with the sparse refresh (cost does not depend on the cached values)
    dcfg = decode_config(bc, "polestar", "dual", bc.threshold)
    pc = dcfg.polestar
    state = init_decode_state(cfg, dcfg, [prompt], bc.prompt_length, seed=bc.seed)
    cs = jnp.int32(bc.prompt_length)
    r_rows = pc.window_rows(bc.block_length)
    for kind, refresh in (("polestar_step", False), ("polestar_refresh_step", True)):
        make = (lambda r: lambda u: lambda p, s, c: step_forward(
            p, s, PSt.geometry(s, c, bc.block_length, pc), cfg, pc, bc.block_length, r, jnp.ones((1,), bool),
            None, unroll=u).logits)(refresh)
        q_rows = bc.block_length + (r_rows if refresh else 0)
        desc = (f"{bc.block_length}-row block" + (f" + {r_rows} refresh rows" if refresh else "")
                + f" against the cache ({length} keys), drift" + (" + cluster proxy attention" if refresh else ""))
        out.append((kind, "dual", make, state, cs, q_rows, length, desc))
    return out


def bench_forwards(params, cfg: ModelConfig, prompt: list[int], bc: BenchConfig) -> list[dict]:
    rows = []
    for kind, cache, make, state, cs, q_rows, keys, desc in forward_kinds(params, cfg, prompt, bc):
        t0 = time.perf_counter()
        compiled = jax.jit(make(1)).lower(params, state, cs).compile()
        compile_s = time.perf_counter() - t0
        for _ in range(max(0, bc.forward_warmup)):
            compiled(params, state, cs).block_until_ready()
        times = []
        for _ in range(max(1, bc.forward_reps)):
            t0 = time.perf_counter()
            compiled(params, state, cs).block_until_ready()
            times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        flops_scan = flops_xla = None
        if bc.flops:
            flops_scan = cost_flops(compiled)
            try:
                flops_xla = cost_flops(jax.jit(make(True)).lower(params, state, cs).compile())
            except Exception as e:  # noqa: BLE001 - FLOPs are a nice-to-have
                _log(f"  (no unrolled cost analysis for {kind}: {type(e).__name__}: {e})")
        flops_an = analytic_flops(cfg, q_rows, keys, bc.block_length)
        gflops = flops_xla / 1e9 if flops_xla is not None else None
        rows.append({
            "kind": kind, "cache": cache, "description": desc, "query_rows": q_rows, "keys": keys,
            "ms_median": ms, "ms_runs": [1e3 * t for t in times], "reps": len(times),
            "compile_seconds": compile_s,
            "gflops_xla": gflops,
            "gflops_xla_scan_body_once": flops_scan / 1e9 if flops_scan is not None else None,
            "gflops_matmul_analytic": flops_an / 1e9,
            "gflop_per_s": (gflops if gflops is not None else flops_an / 1e9) / (ms / 1e3),
        })
        _log(f"  forward {kind}: {ms:.1f} ms" + (f", {gflops:.2f} GFLOP" if gflops is not None else ""))
    return rows


# ------------------------------------------------------------------------------------------------ report


def machine_info() -> dict:
    info = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
    }
    try:
        import jaxlib

        info["jaxlib_version"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    bc = result["config"]
    lines = [
        f"Model `{bc['name']}` ({bc.get('family', 'llada')}): {bc['n_layers']} layers, d_model {bc['d_model']}, "
        f"{bc['n_heads']} heads ({bc.get('n_kv_heads') or bc['n_heads']} KV), "
        f"MLP {bc['mlp_hidden']}, vocab {bc['vocab']}, float32; prompt {bc['prompt_length']}, "
        f"gen {bc['gen_length']}, block {bc['block_length']}, steps {bc['steps']}; Fast-dLLM threshold "
        f"{bc['threshold']}. Variant `peaked` = LM head x{bc['peak_scale']:g}"
        + (" and zero mask-token embedding." if bc["peak_zero_mask_embedding"] else "."),
        "",
        "| model variant | decoder | cache | NFE | TPF | tokens/s | GFLOP/token | refresh steps | compile s | decode s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["decoders"]:
        lines.append(f"| {r['variant']} | {r.get('label', r['decoder'])} | {r['cache']} | {r['nfe']} | {r['tpf']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {_fmt(r.get('gflops_per_token'))} | "
                     f"{r.get('refresh_steps', '')} | {r['compile_seconds']:.2f} | {r['decode_seconds']:.2f} |")
    lines += [
        "",
        "| forward kind | query rows x keys | ms (median) | GFLOP (XLA) | GFLOP (matmul formula) | GFLOP/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for f in result["forwards"]:
        lines.append(f"| {f['kind']} | {f['query_rows']} x {f['keys']} | {f['ms_median']:.1f} | "
                     f"{_fmt(f['gflops_xla'])} | {f['gflops_matmul_analytic']:.2f} | {f['gflop_per_s']:.1f} |")
    ms = {f["kind"]: f["ms_median"] for f in result["forwards"]}
    if "polestar_refresh_step" in ms and "dual_step" in ms:
        lines += ["", f"Polestar refresh step / plain dual-cache step: "
                      f"{ms['polestar_refresh_step'] / ms['dual_step']:.2f}x "
                      f"(Polestar step without refresh: {ms['polestar_step'] / ms['dual_step']:.2f}x)"]
    return "\n".join(lines)


def run_bench(bc: BenchConfig, out_dir: Optional[str] = DEFAULT_OUT, command: str = "") -> dict:
    """Runs the benchmark; writes ``out_dir/bench_decoders.json`` when ``out_dir`` is given; returns the dict."""
    t_start = time.perf_counter()
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    cfg = bc.model_config()
    variants = make_params(bc, cfg)
    prompt = make_prompt(bc, cfg)

    _log(f"[bench] {bc.name}: forwards")
    forwards = bench_forwards(variants["random"], cfg, prompt, bc)
    rows = []
    for variant, params in variants.items():
        for decoder, cache, threshold, label, options in bc.decoders():
            _log(f"[bench] {bc.name}/{variant}: {label} cache={cache}")
            row = bench_decoder(params, cfg, prompt, bc, variant, decoder, cache, threshold, label, options)
            _log(f"  nfe={row['nfe']} tpf={row['tpf']:.2f} tokens/s={row['tokens_per_s']:.1f} "
                 f"decode={row['decode_seconds']:.2f}s compile={row['compile_seconds']:.2f}s")
            rows.append(row)
    n_blocks = bc.gen_length // bc.block_length
    for row in rows:
        row["gflops_per_token"] = gflops_per_token(row, forwards, n_blocks)

    result = {
        "benchmark": "bench_decoders",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": dict(machine_info(), loadavg_start=load_start,
                        loadavg_end=os.getloadavg() if hasattr(os, "getloadavg") else None),
        "config": dataclasses.asdict(bc),
        "notes": [
            "tokens/s = generated positions (gen_length) / decode-loop seconds, compile excluded "
            "(Engine.run's `seconds`); TPF = gen_length / NFE (tpf_non_eos excludes eos/pad).",
            "llada uses the fixed schedule (steps / num_blocks forwards per block, no threshold).",
            "variant 'peaked': LM head scaled by peak_scale (and the mask token's embedding zeroed when "
            "peak_zero_mask_embedding) so that the threshold rule commits several tokens per forward; "
            "the model is random, only speed is meaningful.",
            "forwards: one jitted forward of each kind from polestar_jax.decode.samplers / polestar_step (logits only, batch 1), "
            "median of `reps` runs after warmup; gflops_xla from XLA's cost analysis of the same forward "
            "with the layer scan unrolled (the compiled scan counts its body once: gflops_xla_scan_body_once).",
            "wall-clock on a machine possibly shared with other work: compare rows of one run.",
        ],
        "decoders": rows,
        "forwards": forwards,
        "total_seconds": time.perf_counter() - t_start,
    }
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "bench_decoders.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        result["json_path"] = path
    return result


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_decoders", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2-layer d_model 128 smoke-check size (< 1 minute)")
    ap.add_argument("--family", default="llada", choices=["llada", "dream"],
                    help="model architecture and its samplers (dream: Qwen2 layout with GQA, Dream's samplers)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    ap.add_argument("--peak-scale", type=float, default=None, help="LM-head factor of the peaked variant")
    ap.add_argument("--repeats", type=int, default=None, help="timed decodes per row (median; default 1)")
    ap.add_argument("--forward-reps", type=int, default=None, help="timed runs per forward kind")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--no-flops", action="store_true", help="skip XLA cost analysis")
    args = ap.parse_args(argv)
    bc = {("llada", False): SMALL, ("llada", True): QUICK, ("dream", False): DREAM_SMALL,
          ("dream", True): DREAM_QUICK}[(args.family, args.quick)]
    over = {k: v for k, v in (("peak_scale", args.peak_scale), ("decode_repeats", args.repeats),
                              ("forward_reps", args.forward_reps), ("seed", args.seed)) if v is not None}
    if args.no_flops:
        over["flops"] = False
    bc = dataclasses.replace(bc, **over)
    command = "python -m bench.bench_decoders" + (" " + " ".join(argv if argv is not None else sys.argv[1:])
                                                  if (argv if argv is not None else sys.argv[1:]) else "")
    result = run_bench(bc, args.out, command=command.strip())
    m = result["machine"]
    print(f"# Decoder benchmark ({m['backend']}, {m['cpu_count']} CPUs, jax {m['jax_version']}, "
          f"{result['date']})\n")
    print(markdown(result))
    print(f"\ntotal {result['total_seconds']:.0f} s; JSON: {result.get('json_path', '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
