"""GPU check: per-step latency, achieved HBM bandwidth and FLOP rate of LLaDA-8B-shaped layers.

Builds the LLaDA-8B architecture (``tests/data/llada8b_config.json``: d_model 4096, 32 heads, head dim 128,
MLP 12288, vocab/embedding 126464) with ``n_layers`` cut down to ``--layers`` (default 4) and **random bf16
weights drawn on the device** (``polestar_jax.models.llada.init_params`` under ``jax.jit``, an ``rbg`` key;
nothing is downloaded), then times one forward of each step kind, batch ``--batch``, on the first block
(prompt ``--prompt-length`` + gen ``--gen-length`` = L keys, block ``--block-length`` = B rows):

* ``lm_head``          final RMSNorm + LM head on the B block rows (measured once, so that the per-layer
                       columns can subtract the head: at 8B it reads 1 GiB of weights per call, more than
                       two layers);
* ``full``             ``samplers.full_forward`` over all L rows, cache kept (the block-start pass of Fast-dLLM);
* ``polestar_start``   Polestar's block-start full pass (``polestar_start.block_start_forward``: full forward + k-means of
                       the refresh windows + centroid proxy attention); its output state feeds the Polestar
                       steps below, so they run on real clusters and K/V;
* ``dual_step``        ``samplers.cached_forward`` with the dual cache: B rows against the cached prefix+suffix;
* ``polestar_step``    ``polestar_step.step_forward`` without refresh (B rows + token drift);
* ``polestar_refresh_step``  with the sparse refresh (B + R window rows, cluster drift, K/V and hidden-state
                       patches, suffix logits).

The two Polestar decode steps call the Polestar kernels (``kl_drift``, ``scatter_rows``, ``centroid_shift``)
and are timed twice, with ``PolestarConfig(kernels="pallas")`` (Triton on a GPU, Mosaic on a TPU, the
Pallas interpreter on a CPU) and ``kernels="reference"`` (plain jnp, fused by XLA). The other kinds never
touch the kernel switch (``kernels`` = ``"none"`` in the output): timing them twice would time the same
program twice.

Every kind is one jitted function ``(params, state, cs) -> (outputs, new state)`` with the state donated and
fed back into the next call (as the engine's block loop does), so cache updates are measured as the decoder
pays for them. Per kind: compile seconds (lower + compile) apart, ``--warmup`` untimed calls, then
``--repeats`` timed calls with ``jax.block_until_ready``; the median is reported.

FLOPs come from XLA's cost analysis of the same function lowered with the layer scan unrolled
(``lowered.cost_analysis()``, no compile; a compiled scan counts its body once), else from the matmul
formula. Bytes are a *model* of the minimum HBM traffic of one step (``bytes_model``): weights of the layers
run (+ the LM head once per head call), the whole K/V cache read by attention plus the K/V rows written,
layer input/output hidden rows, and Polestar's stored hidden states / proxy attention where the step uses
them. Achieved GB/s = modelled bytes / median time; TFLOP/s = FLOPs / median time; the roofline time is
``max(bytes / peak HBM bandwidth, FLOPs / peak FLOP rate)`` with the H200 peaks by default (4.8 TB/s HBM3e,
989 TFLOP/s dense bf16; ``--peak-hbm-gbs``, ``--peak-tflops``), and ``roofline_fraction`` = roofline time /
measured time (1.0 = at the roofline). Every row also has a ``per_layer`` part (the LM head's measured time
and its bytes/FLOPs subtracted, then divided by ``--layers``) and ``est_model_depth_ms``: head + 32 x the
per-layer time, the estimate for the real 32-layer model.

How to run (on one H200, from the repository root; about 3-6 minutes, most of it compiling)::

    pip install -e . "jax[cuda12]>=0.10.2,<0.11"
    python -m bench.gpu_check --layers 4 --gen-length 256 --prompt-length 256 --block-length 32 \\
        --out bench/results/gpu_check_h200.json
    # Polestar's hidden-state store int8 in pinned host memory (the step's host<->device copies included)
    python -m bench.gpu_check --kinds polestar_start,polestar_step,polestar_refresh_step \\
        --offload-hidden int8 --out bench/results/gpu_check_h200_int8.json

It writes the JSON after every kind (``--out``, default ``gpu_check.json`` in the current folder), prints a
markdown table, and stops early, keeping what it has, when the wall time passes ``--budget-s`` (default
420 s; a watchdog ends the process ``--hard-stop-s`` seconds in, default budget + 50, even inside a hung
compile). Put the table into README.md ("Kernels and dispatch" / "Benchmarks") with the date and the GPU
(``device_kind`` in the JSON). A kind that fails (for instance a Pallas kernel that does not compile for
this GPU) is recorded with its error and the run goes on.

``--smoke`` runs tiny shapes (2 layers, d_model 128, vocab 512, prompt 32 + gen 64, block 16) on whatever
backend there is, in well under a minute on a CPU; on a CPU ``kernels="pallas"`` runs the Pallas
interpreter and the JSON says that the numbers are not a GPU's (``is_gpu: false`` and a note).

``--family dream`` does the same at Dream-7B shapes (``tests/data/dream7b_config.json``: d_model 3584, 28
query heads sharing 4 KV heads, head dim 128, MLP 18944, vocab 152064, q/k/v biases; 28 layers in the
estimates) with Dream's Polestar parameters (the family's: a full pass clusters 64 rows back and 32 ahead,
one head-averaged proxy attention, the clustered K/V patch); the byte model counts the biases, the K/V
cache of the 4 KV heads and the single proxy-attention head. ``--smoke --family dream``: tiny Dream shapes
(4 query heads on 2 KV heads, prompt 64 so that the 64-row prefix window is filled)::

    python -m bench.gpu_check --family dream --layers 4 --out bench/results/gpu_check_h200_dream.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import threading
import time
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from bench import bench_decoders as BD
from bench.bench_decoders import _fmt
from bench.common import REPO_ROOT
from polestar_jax.models import llada as M
from polestar_jax.models import dream as MD
from polestar_jax.decode.polestar import draws as DR
from polestar_jax.decode.polestar import start as PST
from polestar_jax.decode.polestar import state as PSt
from polestar_jax.decode.polestar import step as PSS
from polestar_jax.decode.block import EngineSpec
from polestar_jax.engine.engine import compiler_options
from polestar_jax.config import DecodeConfig, ModelConfig, PolestarConfig
from polestar_jax.errors import PolestarError
from polestar_jax.models.family import FAMILIES
from polestar_jax.kernels import backend as KB
from polestar_jax.decode.polestar.state import proxy_heads
from polestar_jax.decode.samplers import cached_forward, full_forward
from polestar_jax.decode.layout import init_decode_state

LLADA_8B_CONFIG = os.path.join(REPO_ROOT, "tests", "data", "llada8b_config.json")
DREAM_7B_CONFIG = os.path.join(REPO_ROOT, "tests", "data", "dream7b_config.json")
#: ``--family`` -> the config.json of its full-size shapes
FAMILY_CONFIGS = {"llada": LLADA_8B_CONFIG, "dream": DREAM_7B_CONFIG}

#: Step kinds in run order: the LM head first (the per-layer columns subtract it), the full passes next (their
#: output states feed the steps: a filled K/V cache, real clusters and stored hidden states).
KINDS = ("lm_head", "full", "polestar_start", "dual_step", "polestar_step", "polestar_refresh_step")
#: Step kinds the cost models (shape_info, bytes_model, analytic, roofline) also know, for projections of a
#: decoder's forward mix (``bench.run``): Fast-dLLM's prefix-cache step and Polestar's windowed block start.
#: The check does not time them.
MODEL_KINDS = KINDS + ("prefix_step", "polestar_windowed_start")
#: Kinds that call the Polestar kernels (timed with each of KERNEL_MODES); the others run once ("none").
KERNEL_KINDS = ("polestar_step", "polestar_refresh_step")
KERNEL_MODES = ("pallas", "reference")
#: The kernels the Polestar decode steps dispatch (see kernels/backend.py SUPPORTED).
STEP_KERNELS = ("kl_drift", "gather_rows", "scatter_rows", "centroid_shift")

H200_HBM_GBS = 4800.0  # HBM3e, GB/s (1e9 bytes/s)
H200_BF16_TFLOPS = 989.0  # dense bf16 tensor-core peak, TFLOP/s


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    layers: int = 4
    prompt_length: int = 256
    gen_length: int = 256
    block_length: int = 32
    batch: int = 1
    repeats: int = 20
    warmup: int = 2
    seed: int = 0
    budget_s: float = 420.0
    peak_hbm_gbs: float = H200_HBM_GBS
    peak_tflops: float = H200_BF16_TFLOPS
    smoke: bool = False
    kinds: tuple[str, ...] = KINDS
    model_config: Optional[str] = None  # HF config.json of the shapes (None: the family's, FAMILY_CONFIGS)
    flops: bool = True  # XLA cost analysis of the unrolled lowering
    offload_hidden: str = "none"  # Polestar's hidden-state store: none | int8 | bf16 (pinned_host memory)
    refresh_buckets: Optional[int] = PolestarConfig.refresh_buckets  # compiled widths per refresh stage (none: auto)
    family: str = "llada"  # model family: llada (LLaDA-8B shapes) or dream (Dream-7B shapes)
    engine_options: bool = True  # compile with the engine's XLA options for this backend (False: XLA's defaults)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- model/state


def model_config(cc: CheckConfig) -> tuple[ModelConfig, int]:
    """(config with ``n_layers = cc.layers``, the full model's layer count)."""
    if cc.family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown family {cc.family!r} (choose from {', '.join(FAMILY_CONFIGS)})")
    dream = cc.family == "dream"
    if cc.smoke:  # Dream: GQA (2 KV heads), q/k/v biases, Dream-7B's depth for the estimates
        v = 512
        base = ModelConfig(d_model=128, n_heads=4, n_kv_heads=2 if dream else 4, n_layers=28 if dream else 32,
                           mlp_hidden_size=352, vocab_size=v, embedding_size=v, mask_token_id=v - 1,
                           eos_token_id=v - 2, pad_token_id=v - 2, rope_theta=1e6 if dream else 500000.0,
                           rms_norm_eps=1e-6 if dream else 1e-5, include_qkv_bias=dream, family=cc.family)
    else:
        base = ModelConfig.from_json(cc.model_config or FAMILY_CONFIGS[cc.family])
        if base.family != cc.family:
            raise ValueError(f"{cc.model_config}: a {base.family} config, not {cc.family} (--family)")
    cfg = dataclasses.replace(base, n_layers=cc.layers,
                              max_sequence_length=max(base.max_sequence_length, cc.prompt_length + cc.gen_length))
    cfg.validate("gpu_check")
    return cfg, base.n_layers


def init_params(cfg: ModelConfig, key, dtype=jnp.bfloat16):
    """Random parameters of ``cfg``'s family (Dream: with the q/k/v biases)."""
    return (MD.init_params if cfg.family == "dream" else M.init_params)(cfg, key, dtype=dtype)


def polestar_config(cfg: ModelConfig, cc: CheckConfig, kernels: str = "auto") -> PolestarConfig:
    """Polestar's knobs for ``cfg``'s family (Dream: its official windows, proxy score, K/V patch, tie rule)."""
    return FAMILIES[cfg.family].polestar_config(kernels=kernels, offload_hidden=cc.offload_hidden,
                                                refresh_buckets=cc.refresh_buckets).for_platform(jax.default_backend())


def make_params(cfg: ModelConfig, seed: int):
    """Random bf16 parameters drawn on the default device (jitted ``init_params``, rbg key: fast to compile)."""
    init = jax.jit(lambda k: init_params(cfg, k, dtype=jnp.bfloat16))
    return jax.block_until_ready(init(jax.random.key(seed, impl="rbg")))


def make_state(cfg: ModelConfig, cc: CheckConfig, polestar: bool):
    """Initial decode state (bf16 K/V cache of zeros), random prompts, optionally Polestar's empty cache."""
    rng = np.random.default_rng(cc.seed)
    hi = min(cfg.eos_token_id, cfg.pad_token_id, cfg.mask_token_id)
    prompts = [rng.integers(0, hi, cc.prompt_length).tolist() for _ in range(cc.batch)]
    if polestar:  # (the store in host memory when offloaded, as the engine does)
        dcfg = DecodeConfig(decoder="polestar", gen_length=cc.gen_length, block_length=cc.block_length,
                            polestar=polestar_config(cfg, cc))
    else:
        dcfg = DecodeConfig(decoder="fastdllm", cache="dual", gen_length=cc.gen_length, block_length=cc.block_length)
    return init_decode_state(cfg, dcfg, prompts, cc.prompt_length, seed=cc.seed, dtype=jnp.bfloat16)


def _copy(tree):
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


# ----------------------------------------------------------------------------------------- step kinds


def step_fn(kind: str, cfg: ModelConfig, cc: CheckConfig, kernels: str, unroll: int | bool = 1) -> Callable:
    """``fn(params, state, cs) -> (outputs, state)`` of one step kind (``lm_head``: ``fn(params, h, cs)``);
    ``unroll``: the layer scans' (True for XLA's cost analysis, which counts a loop body once)."""
    B = cc.block_length
    pc = polestar_config(cfg, cc, "reference" if kernels == "none" else kernels)
    if kind == "lm_head":
        return lambda p, h, cs: (M.lm_head(p, h, cfg), h)
    if kind in ("full", "dual_step"):
        cache = "none" if kind == "full" else "dual"
        dcfg = DecodeConfig(decoder="fastdllm", cache=cache, gen_length=cc.gen_length, block_length=B,
                            threshold=0.9)
        spec = EngineSpec.from_config(cfg, dcfg, unroll=unroll)
        if kind == "full":
            return lambda p, s, cs: full_forward(p, s, spec, cs, keep_cache=True)
        return lambda p, s, cs: cached_forward(p, s, spec, cs)
    if kind == "polestar_start":
        def start(p, s, cs):  # (the full pass's window, as polestar.start: Dream's 64 / 32 rows)
            geo = PSt.geometry(s, cs, B, pc, window=pc.pass_window(B, False))
            draws = DR.block_start_draws(s, geo, cfg, pc, B, None)
            out = PST.block_start_forward(p, s, geo, cfg, pc, B, False, draws, unroll=unroll)
            pol = s.policy_state.replace(hs=out.hs, hs_scale=out.hs_scale, labels=out.clusters.labels, centroids=out.clusters.centroids,
                                     counts=out.clusters.counts, n_clusters=out.clusters.n, s_prev=out.s_prev,
                                     p_prev=out.p_prev)
            return out.logits, s.replace(k_cache=out.k, v_cache=out.v, policy_state=pol)
        return start
    if kind in ("polestar_step", "polestar_refresh_step"):
        refresh = kind == "polestar_refresh_step"

        def step(p, s, cs):
            geo = PSt.geometry(s, cs, B, pc)
            rows = jnp.ones((s.x.shape[0],), bool)
            out = PSS.step_forward(p, s, geo, cfg, pc, B, refresh, rows, None, unroll=unroll)
            pol = s.policy_state.replace(hs=out.hs, hs_scale=out.hs_scale, centroids=out.centroids, s_prev=out.s_prev, p_prev=out.p_blk)
            return (out.logits, out.logits_suf, out.drift), s.replace(k_cache=out.k, v_cache=out.v, policy_state=pol)
        return step
    raise ValueError(f"unknown step kind {kind!r}")


def geometry_numbers(cfg: ModelConfig, cc: CheckConfig) -> dict:
    """L keys, B block rows, R refresh-window rows (the store: LLaDA 3B; Dream max(64, 2B) + max(32, B)),
    its suffix rows, K clusters and the heads of the cluster proxy attention (Dream: 1)."""
    pc = polestar_config(cfg, cc)
    B = cc.block_length
    return {"L": cc.prompt_length + cc.gen_length, "B": B, "R": pc.window_rows(B),
            "suffix_rows": pc.suffix_rows(B), "K": pc.n_clusters, "proxy_heads": proxy_heads(cfg, pc)}


def shape_info(kind: str, cfg: ModelConfig, cc: CheckConfig, refresh_rows: Optional[float] = None) -> dict:
    """query rows, keys, LM-head calls and a description of one step kind (``KINDS``, or one of
    ``MODEL_KINDS``, which only the cost models know). ``refresh_rows`` (``polestar_refresh_step``): the window
    rows the refresh computes per layer (mean over layers; default all R rows, a dense refresh)."""
    g = geometry_numbers(cfg, cc)
    L, B, R, S = g["L"], g["B"], g["R"], g["suffix_rows"]
    if refresh_rows is not None:
        if kind != "polestar_refresh_step":
            raise ValueError(f"refresh_rows applies to polestar_refresh_step only, not {kind!r}")
        R = refresh_rows
    if kind == "lm_head":
        return dict(query_rows=B, keys=0, head_calls=1, head_rows=B,
                    description=f"RMSNorm + LM head of {B} rows (no layers)")
    if kind == "full":
        return dict(query_rows=L, keys=L, head_calls=1, head_rows=B,
                    description=f"all {L} rows, K/V kept (LM head on the {B}-row block)")
    if kind == "polestar_start":
        return dict(query_rows=L, keys=L, head_calls=1, head_rows=B,
                    description=f"Polestar block start: all {L} rows + k-means of {R} window rows + proxy attention")
    if kind == "dual_step":
        return dict(query_rows=B, keys=L, head_calls=1, head_rows=B,
                    description=f"{B} block rows against the cached prefix+suffix ({L} keys)")
    if kind == "polestar_step":
        return dict(query_rows=B, keys=L, head_calls=1, head_rows=B,
                    description=f"{B} block rows against the cache ({L} keys) + token drift")
    if kind == "polestar_refresh_step":
        # (the block and the refreshed suffix rows share one LM-head GEMM: its weights are read once)
        return dict(query_rows=B + R, keys=L, head_calls=1, head_rows=B + S,
                    description=f"{B} block rows + {R:g} refresh rows ({L} keys), cluster drift, patches, "
                                f"suffix logits")
    if kind == "prefix_step":
        G = cc.gen_length
        return dict(query_rows=G, keys=L, head_calls=1, head_rows=B,
                    description=f"{G} generation rows against the cached prefix ({L} keys)")
    if kind == "polestar_windowed_start":
        return dict(query_rows=B + R, keys=L, head_calls=1, head_rows=B,
                    description=f"Polestar windowed block start: the {B + R}-row window ({L} keys) + k-means "
                                "+ proxy attention")
    raise ValueError(kind)


def bytes_model(kind: str, cfg: ModelConfig, cc: CheckConfig, refresh_rows: Optional[float] = None) -> dict:
    """Minimum HBM traffic of one step (bytes): ``per_layer`` (weights, K/V, hidden rows, Polestar state of
    one layer), ``once`` (LM head weights per head call, embedding rows, logits, last-layer drift rows), and
    ``total = layers * per_layer + once``. A model, not a measurement: XLA's own (pre-fusion) count is the
    row's ``xla_bytes_accessed``. ``refresh_rows``: see :func:`shape_info` (the stored hidden states read and
    written are those rows)."""
    g = geometry_numbers(cfg, cc)
    L, B, R, K, HP = g["L"], g["B"], g["R"], g["K"], g["proxy_heads"]
    if refresh_rows is not None and kind == "polestar_refresh_step":
        R = refresh_rows
    b, it, f32 = cc.batch, 2, 4  # bf16 weights/activations, float32 probabilities and logits
    D, F, H, KV, hd, V = (cfg.d_model, cfg.mlp_hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                          cfg.embedding_size)
    si = shape_info(kind, cfg, cc, refresh_rows)
    q = si["query_rows"]
    bias = (H * hd + 2 * KV * hd) if cfg.include_qkv_bias else 0  # Dream's q/k/v biases
    w_layer = (D * H * hd + 2 * D * KV * hd + H * hd * D + 3 * D * F + 2 * D + bias) * it
    kv_rows = lambda n: 2 * b * KV * n * hd * it  # K and V of n rows
    head = si["head_calls"] * (D * V + D) * it + b * si["head_rows"] * (D * it + V * f32)
    per = {"weights": 0, "kv": 0, "hidden": 0, "polestar": 0}
    once = {"lm_head": head, "embedding": b * q * D * it if kind != "lm_head" else 0, "drift": 0}
    if kind != "lm_head":
        per["weights"] = w_layer
        per["hidden"] = 2 * b * q * D * it  # layer input read + output written
        if kind in ("full", "polestar_start"):
            per["kv"] = 2 * kv_rows(L)  # written, then read by attention
        else:
            per["kv"] = kv_rows(L) + kv_rows(q)  # whole cache read + the rows' K/V written
    if kind in ("polestar_start", "polestar_windowed_start"):
        per["polestar"] = b * R * D * it + b * HP * K * L * f32  # stored window rows + proxy attention written
        once["drift"] = b * H * B * L * f32  # last layer's block probabilities written
    if kind == "polestar_step":
        once["drift"] = 2 * b * H * B * L * f32  # previous block probabilities read, new ones written
    if kind == "polestar_refresh_step":
        per["polestar"] = 2 * b * R * D * it + 2 * b * HP * K * L * f32  # hidden states, proxy attention r+w
        once["drift"] = 2 * b * H * B * L * f32
    n = 0 if kind == "lm_head" else cfg.n_layers
    per_total, once_total = sum(per.values()), sum(once.values())
    return {"per_layer": per, "once": once, "per_layer_total": per_total, "once_total": once_total,
            "total": n * per_total + once_total}


def analytic(kind: str, cfg: ModelConfig, cc: CheckConfig, refresh_rows: Optional[float] = None
             ) -> tuple[float, float]:
    """(total, LM-head part) matmul FLOPs of one step: projections, MLP, attention, LM head (batch included).
    ``refresh_rows``: see :func:`shape_info`."""
    si = shape_info(kind, cfg, cc, refresh_rows)
    head = 2.0 * cc.batch * si["head_rows"] * cfg.d_model * cfg.embedding_size
    if kind == "lm_head":
        return head, head
    one = BD.analytic_flops(cfg, si["query_rows"], si["keys"], si["head_rows"])  # batch 1
    return cc.batch * one, head


def roofline(kind: str, cfg: ModelConfig, cc: CheckConfig, refresh_rows: Optional[float] = None) -> dict:
    """The roofline cost of one step from the models alone (no device): ``bytes`` (:func:`bytes_model`),
    ``flops`` (:func:`analytic`, the matmul formula) and ``seconds = max(bytes / peak HBM bandwidth, flops /
    peak FLOP rate)`` at ``cc``'s peaks, with ``bound`` saying which term wins. A model, not a measurement
    (:mod:`bench.run` projects tokens/s from it)."""
    bm = bytes_model(kind, cfg, cc, refresh_rows)["total"]
    flops = analytic(kind, cfg, cc, refresh_rows)[0]
    t_mem, t_flop = bm / (cc.peak_hbm_gbs * 1e9), flops / (cc.peak_tflops * 1e12)
    return {"bytes": bm, "flops": flops, "seconds": max(t_mem, t_flop), "mem_seconds": t_mem,
            "flop_seconds": t_flop, "bound": "memory" if t_mem >= t_flop else "compute"}


def _cost_value(obj, key: str) -> Optional[float]:
    try:
        ca = obj.cost_analysis()
    except Exception:  # noqa: BLE001 - best effort on every backend
        return None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    if not isinstance(ca, dict) or key not in ca:
        return None
    try:
        v = float(ca[key])
    except (TypeError, ValueError):
        return None
    return v if v >= 0 else None


# -------------------------------------------------------------------------------------------- timing


class Clock:
    def __init__(self, budget_s: float):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over(self) -> bool:
        return self.elapsed() > self.budget_s


def time_kind(kind: str, kernels: str, params, state, cfg: ModelConfig, cc: CheckConfig, clock: Clock,
              head_ms: Optional[float], model_layers: int) -> tuple[dict, Any]:
    """Compiles and times one (kind, kernels); returns the result row and the last output state."""
    si = shape_info(kind, cfg, cc)
    row: dict[str, Any] = {"kind": kind, "kernels": kernels, **si}
    fn = step_fn(kind, cfg, cc, kernels)
    cs = jnp.int32(cc.prompt_length)  # first block
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers.*")
        compiled = jax.jit(fn, donate_argnums=(1,)).lower(params, state, cs).compile(  # the engine's options
            compiler_options(jax.default_backend()) if cc.engine_options else None)
    row["compile_seconds"] = time.perf_counter() - t0

    def call(s):
        out, s = compiled(params, s, cs)
        jax.block_until_ready((out, s))
        return s

    s = _copy(state)
    for _ in range(max(0, cc.warmup)):
        s = call(s)
    times = []
    for i in range(max(1, cc.repeats)):
        t = time.perf_counter()
        s = call(s)
        times.append(time.perf_counter() - t)
        if clock.over():
            row["repeats_cut_by_budget"] = True
            break
    ms = 1e3 * statistics.median(times)
    row.update(ms_median=ms, ms_min=1e3 * min(times), ms_runs=[1e3 * t for t in times], reps=len(times))

    # FLOPs / bytes: XLA's cost analysis of the unrolled lowering (no compile), else the matmul formula
    flops_an, head_flops = analytic(kind, cfg, cc)
    flops_xla = bytes_xla = None
    if cc.flops:
        try:
            lowered = jax.jit(step_fn(kind, cfg, cc, kernels, unroll=True)).lower(params, state, cs)
            flops_xla = BD.cost_flops(lowered)
            bytes_xla = _cost_value(lowered, "bytes accessed")
        except Exception as e:  # noqa: BLE001 - FLOPs are a nice-to-have
            _log(f"  (no cost analysis for {kind}: {type(e).__name__}: {e})")
    flops = flops_xla if flops_xla else flops_an
    bm = bytes_model(kind, cfg, cc)
    sec = ms / 1e3
    t_mem = bm["total"] / (cc.peak_hbm_gbs * 1e9)
    t_flop = flops / (cc.peak_tflops * 1e12)
    row.update(
        flops=flops, flops_source="xla" if flops_xla else "analytic", flops_xla=flops_xla,
        flops_analytic=flops_an, xla_bytes_accessed=bytes_xla, bytes_model=bm, bytes=bm["total"],
        achieved_gb_s=bm["total"] / sec / 1e9, achieved_tflop_s=flops / sec / 1e12,
        roofline_ms=1e3 * max(t_mem, t_flop), roofline_mem_ms=1e3 * t_mem, roofline_flop_ms=1e3 * t_flop,
        bound="memory" if t_mem >= t_flop else "compute",
        roofline_fraction=max(t_mem, t_flop) / sec,
        hbm_fraction=bm["total"] / sec / (cc.peak_hbm_gbs * 1e9),
    )
    if kind != "lm_head":
        n = cfg.n_layers
        head_part = si["head_calls"] * head_ms if head_ms is not None else 0.0
        layer_ms = max(ms - head_part, 0.0) / n
        layer_flops = max(flops - head_flops, 0.0) / n
        layer_bytes = bm["per_layer_total"]
        lsec = layer_ms / 1e3
        lt = max(layer_bytes / (cc.peak_hbm_gbs * 1e9), layer_flops / (cc.peak_tflops * 1e12))
        row["per_layer"] = {
            "ms": layer_ms, "head_subtracted": head_ms is not None, "bytes": layer_bytes, "flops": layer_flops,
            "achieved_gb_s": layer_bytes / lsec / 1e9 if lsec > 0 else None,
            "achieved_tflop_s": layer_flops / lsec / 1e12 if lsec > 0 else None,
            "roofline_ms": 1e3 * lt, "roofline_fraction": lt / lsec if lsec > 0 else None,
        }
        row["est_model_depth_ms"] = head_part + model_layers * layer_ms
    return row, s


# ------------------------------------------------------------------------------------------- report


def table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"{result['device_kind']} ({result['backend']}), jax {result['jax_version']}, {result['date']}; "
        f"{c.get('family', 'llada')}: {c['layers']} of {c['model_layers']} layers, d_model {c['d_model']}, "
        f"{c['n_heads']} heads / {c['n_kv_heads']} KV heads, MLP {c['mlp_hidden']}, vocab "
        f"{c['vocab']}, bf16, batch {c['batch']}, prompt {c['prompt_length']} + gen {c['gen_length']}, block "
        f"{c['block_length']}; peaks {c['peak_hbm_gbs']:g} GB/s, {c['peak_tflops']:g} TFLOP/s",
        "",
        "| kind | kernels | ms | compile s | GB/s | TFLOP/s | roofline | bound | ms/layer | GB/s/layer | "
        f"est. {c['model_layers']}-layer ms |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in result["results"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['kind']} | {r['kernels']} | {r.get('status')}: {r.get('error', '')[:60]} "
                         "| | | | | | | | |")
            continue
        pl = r.get("per_layer") or {}
        lines.append(
            f"| {r['kind']} | {r['kernels']} | {r['ms_median']:.3f} | {r['compile_seconds']:.1f} | "
            f"{r['achieved_gb_s']:.0f} | {r['achieved_tflop_s']:.1f} | {100 * r['roofline_fraction']:.0f}% | "
            f"{r['bound']} | {_fmt(pl.get('ms'), '.3f')} | {_fmt(pl.get('achieved_gb_s'), '.0f')} | "
            f"{_fmt(r.get('est_model_depth_ms'), '.2f')} |")
    for kind, ratio in result.get("pallas_over_reference", {}).items():
        lines.append(f"\n{kind}: pallas / reference time = {ratio:.2f}x")
    if result.get("stopped_early"):
        lines.append(f"\nstopped early at {result['total_seconds']:.0f} s (budget {c['budget_s']:g} s); "
                     f"skipped: {', '.join(result['skipped'])}")
    if not result["is_gpu"]:
        lines.append("\nNOT A GPU: " + result["note"])
    return "\n".join(lines)


def _write(result: dict, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def run_check(cc: CheckConfig, out_path: Optional[str], command: str = "") -> dict:
    clock = Clock(cc.budget_s)
    cfg, model_layers = model_config(cc)
    dev = jax.devices()[0]
    backend = jax.default_backend()
    is_gpu = dev.platform == "gpu"
    try:
        import jaxlib
        jaxlib_version = jaxlib.__version__
    except Exception:  # noqa: BLE001
        jaxlib_version = None
    result: dict[str, Any] = {
        "benchmark": "gpu_check",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "jax_version": jax.__version__, "jaxlib_version": jaxlib_version,
        "backend": backend, "device_kind": dev.device_kind, "device_count": jax.device_count(),
        "is_gpu": is_gpu, "smoke": cc.smoke,
        "note": ("" if is_gpu else f"backend {backend!r} ({dev.device_kind}): not a GPU; timings, bandwidth and "
                 "roofline fractions are meaningless against the H200 peaks and must not go into the README"
                 + ("; 'pallas' runs the Pallas interpreter here" if backend == "cpu" else "")),
        "config": dict(dataclasses.asdict(cc), kinds=list(cc.kinds),
                       model_config=None if cc.smoke else cc.model_config or FAMILY_CONFIGS[cc.family],
                       d_model=cfg.d_model, n_heads=cfg.n_heads,
                       n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, mlp_hidden=cfg.mlp_hidden_size,
                       vocab=cfg.embedding_size, model_layers=model_layers, dtype="bfloat16",
                       **{k: v for k, v in geometry_numbers(cfg, cc).items()}),
        "kernels_resolved": {m: {k: KB.resolve_backend(m, kernel=k) for k in STEP_KERNELS} for m in KERNEL_MODES},
        "notes": [
            "ms: median of `reps` timed calls after `warmup` calls; compile_seconds = lower + compile, apart.",
            "bytes: bytes_model (minimum HBM traffic: weights of the layers + LM head per head call, whole K/V "
            "cache read + rows written, layer in/out hidden rows, Polestar state); achieved_gb_s = bytes / ms.",
            "flops: XLA cost analysis of the unrolled lowering (flops_source 'xla'), else the matmul formula.",
            "roofline_ms = max(bytes / peak_hbm, flops / peak_flops); roofline_fraction = roofline_ms / ms.",
            "per_layer: (ms - head_calls * lm_head ms) / layers, bytes and flops without the LM head; "
            "est_model_depth_ms = head part + model_layers * per_layer ms.",
            "kernels 'none': the step does not call the Polestar kernels (timed once).",
        ],
        "results": [], "skipped": [], "stopped_early": False,
    }
    _log(f"[gpu_check] {dev.device_kind} ({backend}); {cfg.n_layers} layers d_model {cfg.d_model}; "
         f"budget {cc.budget_s:g} s")
    t0 = time.perf_counter()
    params = make_params(cfg, cc.seed)
    result["param_init_seconds"] = time.perf_counter() - t0
    result["param_bytes"] = int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params)))
    _log(f"  params: {result['param_bytes'] / 2**30:.2f} GiB in {result['param_init_seconds']:.1f} s")

    plan = [(k, m) for k in KINDS if k in cc.kinds for m in (KERNEL_MODES if k in KERNEL_KINDS else ("none",))]
    base = make_state(cfg, cc, polestar=False)
    pol_base = make_state(cfg, cc, polestar=True)
    head_ms = None
    for kind, kernels in plan:
        if clock.over():
            result["stopped_early"] = True
            result["skipped"].append(f"{kind}/{kernels}")
            continue
        if kind == "lm_head":
            state = jnp.zeros((cc.batch, cc.block_length, cfg.d_model), jnp.bfloat16) + jnp.bfloat16(0.5)
        elif kind == "dual_step":
            state = base
        elif kind == "full":
            state = make_state(cfg, cc, polestar=False)
        elif kind == "polestar_start":
            state = make_state(cfg, cc, polestar=True)
        else:
            state = pol_base
        _log(f"  {kind} / {kernels} ...")
        try:
            row, out_state = time_kind(kind, kernels, params, state, cfg, cc, clock, head_ms, model_layers)
            row["status"] = "ok"
            if kind == "lm_head":
                head_ms = row["ms_median"]
            elif kind == "full":
                base = out_state  # a filled K/V cache for the dual-cache step
            elif kind == "polestar_start":
                pol_base = out_state  # clusters, stored hidden states, proxy attention for the Polestar steps
            _log(f"    {row['ms_median']:.3f} ms (compile {row['compile_seconds']:.1f} s), "
                 f"{row['achieved_gb_s']:.0f} GB/s, {row['achieved_tflop_s']:.2f} TFLOP/s, "
                 f"{100 * row['roofline_fraction']:.0f}% of roofline ({row['bound']})")
        except Exception as e:  # noqa: BLE001 - record and go on (e.g. a kernel without a lowering here)
            row = {"kind": kind, "kernels": kernels, "status": "error", "error": f"{type(e).__name__}: {e}"[:2000]}
            _log(f"    error: {row['error'][:300]}")
        result["results"].append(row)
        result["total_seconds"] = clock.elapsed()
        if out_path:
            _write(result, out_path)
    by = {(r["kind"], r["kernels"]): r for r in result["results"] if r.get("status") == "ok"}
    result["pallas_over_reference"] = {
        k: by[(k, "pallas")]["ms_median"] / by[(k, "reference")]["ms_median"]
        for k in KERNEL_KINDS if (k, "pallas") in by and (k, "reference") in by}
    result["total_seconds"] = clock.elapsed()
    if out_path:
        _write(result, out_path)
        result["json_path"] = out_path
    return result


def _watchdog(seconds: float, out_path: Optional[str]) -> Optional[threading.Timer]:
    """Ends the process ``seconds`` in, even inside a compile (the JSON written so far stays)."""
    if not seconds or seconds <= 0:
        return None

    def fire():
        _log(f"[gpu_check] hard stop after {seconds:g} s; partial JSON: {out_path}")
        if out_path and os.path.exists(out_path):
            try:
                with open(out_path) as f:
                    data = json.load(f)
                data.update(stopped_early=True, hard_stopped=True)
                _write(data, out_path)
            except Exception:  # noqa: BLE001
                pass
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="layers to build and run (default 4; --smoke 2)")
    ap.add_argument("--gen-length", type=int, default=None, help="default 256 (--smoke 64)")
    ap.add_argument("--prompt-length", type=int, default=None, help="default 256 (--smoke 32; dream 64)")
    ap.add_argument("--block-length", type=int, default=None, help="default 32 (--smoke 16)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per kind (median; default 20, --smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls per kind (default 2, --smoke 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="gpu_check.json", help="JSON output (default: %(default)s in the cwd)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new kinds after this (s)")
    ap.add_argument("--hard-stop-s", type=float, default=None,
                    help="end the process after this many seconds, whatever it is doing (default budget + 50; 0: off)")
    ap.add_argument("--peak-hbm-gbs", type=float, default=H200_HBM_GBS, help="HBM peak, GB/s (H200: %(default)g)")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS,
                    help="dense bf16 peak, TFLOP/s (H200: %(default)g)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma list from: " + ", ".join(KINDS))
    ap.add_argument("--family", default="llada", choices=sorted(FAMILY_CONFIGS),
                    help="model family: llada (LLaDA-8B shapes) or dream (Dream-7B shapes, GQA, Dream's Polestar)")
    ap.add_argument("--model-config", default=None,
                    help="HF config.json of the model shape (default: the family's, tests/data/llada8b_config.json "
                         "or dream7b_config.json)")
    ap.add_argument("--no-flops", action="store_true", help="skip XLA cost analysis (matmul formula only)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any backend, < 1 minute on a CPU")
    ap.add_argument("--offload-hidden", default="none", choices=["none", "int8", "bf16"],
                    help="Polestar's hidden-state store in host memory (run once with and once without)")
    ap.add_argument("--xla-defaults", action="store_true",
                    help="compile with XLA's default options, not the engine's (what every kind ran with before)")
    ap.add_argument("--refresh-buckets", type=int, default=PolestarConfig.refresh_buckets,
                    help="compiled widths per refresh stage (1: every window row, as a dense refresh; default: "
                         "the engine's for this backend, 1 on a GPU)")
    args = ap.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"unknown kind(s) {', '.join(bad)} (choose from {', '.join(KINDS)})")
    pick = lambda v, full, smoke: v if v is not None else (smoke if args.smoke else full)
    cc = CheckConfig(layers=pick(args.layers, 4, 2),
                     prompt_length=pick(args.prompt_length, 256, 64 if args.family == "dream" else 32),
                     gen_length=pick(args.gen_length, 256, 64), block_length=pick(args.block_length, 32, 16),
                     batch=args.batch, repeats=pick(args.repeats, 20, 2), warmup=pick(args.warmup, 2, 1),
                     seed=args.seed, budget_s=args.budget_s, peak_hbm_gbs=args.peak_hbm_gbs,
                     peak_tflops=args.peak_tflops, smoke=args.smoke, kinds=kinds, model_config=args.model_config,
                     flops=not args.no_flops, offload_hidden=args.offload_hidden,
                     refresh_buckets=args.refresh_buckets, family=args.family, engine_options=not args.xla_defaults)
    if args.refresh_buckets is not None and args.refresh_buckets < 1:
        ap.error("--refresh-buckets must be >= 1")
    try:
        cfg, _ = model_config(cc)
    except (ValueError, PolestarError) as e:
        ap.error(str(e))
    pre = polestar_config(cfg, cc).prefix_rows(cc.block_length)
    if cc.gen_length % cc.block_length or cc.prompt_length < pre:
        ap.error(f"gen length must be a multiple of the block length, and the prompt at least {pre} tokens long "
                 "(the refresh prefix window)")
    hard = args.hard_stop_s if args.hard_stop_s is not None else cc.budget_s + 50
    dog = _watchdog(hard, args.out)
    raw = argv if argv is not None else sys.argv[1:]
    try:
        result = run_check(cc, args.out, command=" ".join(["python -m bench.gpu_check", *raw]))
    finally:
        if dog is not None:
            dog.cancel()
    print(table(result))
    print(f"\ntotal {result['total_seconds']:.0f} s; JSON: {result.get('json_path', '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
