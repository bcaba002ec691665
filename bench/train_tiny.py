"""Trains the tiny LLaDA of issue #6 on the synthetic tasks of :mod:`bench.tasks` (CPU, optax, orbax).

Objective: LLaDA's SFT loss. Per example ``t ~ U(eps, 1)``; each answer token (the answer padded with EOS to
the generation length ``G``; the EOS padding is part of the answer) is replaced by the mask token with
probability ``t``; the prompt is never masked. The loss is the cross-entropy on the masked answer tokens
weighted by ``1/t``, summed and divided by the number of answer tokens ``G``, averaged over the batch.

Block-structured rows (``block_mask_prob``, issue #13): every decoder here writes an answer block by block, so
at inference the answer is clean before the current block, partly masked inside it and wholly masked after
it. Independent masks almost never look like that on long answers, and a model trained on them alone can be
right on nearly every token from a fully masked answer and still fall apart once a clean prefix is revealed
(``tiny_long`` run 3, ``bench/probe_prefix.py``: 99.6% of ``long_copy`` tokens from the all-masked answer,
35% of the rest once its first block holds the right tokens). With probability ``block_mask_prob`` a row instead draws a block start
``c = j * block_length`` (``j`` uniform over the blocks): positions before ``c`` are clean, those of block
``j`` masked with probability ``t``, all later ones masked; its loss is the mean cross-entropy over its
masked tokens (the same scale as the ``1/t``-weighted sum of an independent row).

Row layout (prompt LEFT-aligned): ``[chat prompt ids][answer ids + EOS * (G - len)][pad]``; the pad is hidden
from attention with ``key_valid``; RoPE positions are ``0..`` per row. This is what
the engine (:class:`polestar_jax.engine.engine.Engine`) sees at inference (it left-pads prompts but starts every row's
positions at its first real token and hides the padding), so a trained row and a decoded row look alike.

Tokenizer: the byte-level tokenizer of the bundled model folder (``polestar_jax/assets/tiny_random``:
ids 0..255 = bytes, then ``<|startoftext|>``, ``<|endoftext|>`` (EOS = pad), the chat header tokens,
``<|eot_id|>``, ``<|mdm_mask|>``); prompts are the chat-template rendering of the task prompt
(:meth:`polestar_jax.io.tokenizer.Tokenizer.chat_prompt_ids`).

Mixture of experts (``--preset tiny_moe``, issue #45): ``family="llada_moe"`` trains a LLaDA-MoE
(:mod:`polestar_jax.models.llada_moe`: q/k-norm, ``n_experts`` SwiGLU experts of ``mlp_hidden`` per layer, the
raw top-``top_k`` softmax weights) with the same SFT loss plus ``aux_loss_coef`` times the load-balancing loss
(:func:`balance_loss`, the Switch Transformer / OLMoE form: ``E * sum_e f_e * P_e`` per layer, mean over the
layers), so that the router spreads the tokens over its experts instead of collapsing onto a few. The
training forward is the family's layer with its MoE block computed densely (:func:`dense_experts`: the same
function to rounding, k times fewer FLOPs than ``ragged_dot``'s CPU lowering); the exported folder is an HF
LLaDA-MoE folder (``architectures`` ["LLaDAMoEModelLM"]) whose README adds each layer's expert use.

Checkpoints: an orbax ``CheckpointManager`` in ``--out`` holds the params, optimizer state and step
(``state``) and a JSON item (``meta``: the numpy data-RNG state, the training configuration, the
accumulated training time and the log history), every ``--save-every`` steps and at the end of each run.
A run is reproducible from ``--seed``: the data stream is ``numpy.random.default_rng(seed)`` and the
masking noise of step ``s`` is ``fold_in(PRNGKey(seed), s)``; an interrupted and resumed run gives the
same losses as an uninterrupted one.

Usage::

    # train (or continue with --resume) up to --steps, at most --max-minutes in this piece
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \\
      taskset -c 1 python -m bench.train_tiny --out /tmp/tiny_ckpt --steps 6000 [--resume] [--max-minutes 80]
    # export the latest checkpoint as an HF folder (+ final evaluation in its README)
    python -m bench.train_tiny --out /tmp/tiny_ckpt --resume --steps 6000 --export polestar_jax/assets/tiny_tasks
    # the long-answer model of issue #13, fine-tuned from tiny_tasks (--preset is saved in the checkpoint;
    # --resume reuses it)
    python -m bench.train_tiny --preset tiny_long --out /work/tiny_long_ckpt --save-every 100
    python -m bench.train_tiny --out /work/tiny_long_ckpt --export-only --export polestar_jax/assets/tiny_long
    # the LLaDA-MoE test bed of issue #45 (from scratch; list tasks, copy and reverse weighted 3)
    python -m bench.train_tiny --preset tiny_moe --out /work/moe_ckpt --eval-every 500 --eval-n 16
    python -m bench.train_tiny --out /work/moe_ckpt --export-only --export polestar_jax/assets/tiny_moe
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shlex
import sys
import time
from collections import defaultdict
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import tasks as T  # noqa: E402
from polestar_jax import cli  # noqa: E402
from polestar_jax.models import llada as M  # noqa: E402
from polestar_jax.models import llada_moe as MOE  # noqa: E402
from polestar_jax.io.checkpoint import param_shapes  # noqa: E402
from polestar_jax.config import DecodeConfig, ModelConfig, MoeConfig  # noqa: E402
from polestar_jax.errors import PolestarError  # noqa: E402
from polestar_jax.io.tokenizer import Tokenizer, asset_model_dir, load_tokenizer  # noqa: E402

#: The bundled folder whose byte-level tokenizer and chat template the tiny model uses.
TOKENIZER_SOURCE = "tiny_random"

__all__ = ["TrainError", "TrainConfig", "parse_task_weights", "AnswerMask", "answer_mask", "model_config",
           "answer_ids", "make_batch", "make_optimizer", "make_train_step", "train", "evaluate", "export", "main"]


class TrainError(PolestarError):
    """A training request that cannot be carried out (an invalid configuration, a checkpoint that does not
    match it, weights of other shapes); :func:`main` prints it as one ``error:`` line and exits with 2."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run (saved in the checkpoint; a resume must match it, except
    ``steps`` which may be raised to continue training)."""

    seed: int = 0
    steps: int = 6000
    batch: int = 64
    gen_length: int = 32  # longest answer is 27 characters (+ EOS padding)
    block_length: int = 8
    prompt_slot: int = 68  # longest chat prompt in tokens (67); rows are prompt_slot + gen_length long
    # model
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    mlp_hidden: int = 352
    max_sequence_length: int = 256
    rope_theta: float = 10000.0
    init_std: float = 0.02
    # the model family: "llada" (dense SwiGLU MLP of mlp_hidden) or "llada_moe" (LLaDA-MoE: q/k-norm and
    # n_experts SwiGLU experts of mlp_hidden each, top_k per token, trained with the load-balancing loss)
    family: str = "llada"
    n_experts: int = 0
    top_k: int = 0
    # weight of the load-balancing loss (Switch / OLMoE form, see :func:`balance_loss`; MoE only)
    aux_loss_coef: float = 0.0
    # optimizer
    lr: float = 1e-3
    warmup: int = 200
    end_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    b2: float = 0.98
    clip: float = 1.0
    eps: float = 1e-3  # t ~ U(eps, 1)
    # share of rows with a block-structured mask (clean blocks, the current block at rate t, masked blocks)
    block_mask_prob: float = 0.0
    # data
    tasks: tuple[str, ...] = T.TASK_NAMES
    task_weights: Optional[tuple[float, ...]] = None  # None: uniform
    # tasks of the periodic and export evaluations (None: ``tasks``)
    eval_tasks: Optional[tuple[str, ...]] = None
    # weights that start the run instead of random ones: a bundled asset name (``tiny_tasks``) or a model
    # folder with the same architecture (fine-tuning; None: random init from ``seed``)
    init_from: Optional[str] = None
    # the named setting this run started from (:data:`PRESETS`); checkpoints saved before it existed are
    # tiny_tasks runs
    preset: str = "tiny_tasks"

    def __post_init__(self):
        for name in ("steps", "batch", "gen_length", "block_length"):
            if getattr(self, name) <= 0:
                raise TrainError(f"{name} must be positive, got {getattr(self, name)}")
        if not (np.isfinite(self.lr) and self.lr > 0):
            raise TrainError(f"lr must be a positive number, got {self.lr}")
        if not 0.0 <= self.block_mask_prob <= 1.0:
            raise TrainError(f"block_mask_prob must lie in [0, 1], got {self.block_mask_prob}")
        if self.gen_length % self.block_length:
            raise TrainError(f"gen_length {self.gen_length} must be a multiple of block_length {self.block_length}")
        if not self.tasks:
            raise TrainError("a run needs at least one task")
        if self.family not in ("llada", "llada_moe"):
            raise TrainError(f"family must be llada or llada_moe, got {self.family!r}")
        if self.family == "llada_moe" and not 1 <= self.top_k <= self.n_experts:
            raise TrainError(f"llada_moe needs 1 <= top_k <= n_experts, got top_k {self.top_k}, "
                             f"n_experts {self.n_experts}")
        if self.family == "llada" and (self.n_experts or self.top_k or self.aux_loss_coef):
            raise TrainError("n_experts, top_k and aux_loss_coef are options of family llada_moe")
        if not (np.isfinite(self.aux_loss_coef) and self.aux_loss_coef >= 0):
            raise TrainError(f"aux_loss_coef must be finite and >= 0, got {self.aux_loss_coef}")
        unknown = [t for t in (*self.tasks, *(self.eval_tasks or ())) if t not in T.TASKS]
        if unknown:
            raise TrainError(f"unknown task(s) {', '.join(unknown)}")
        if self.task_weights is not None:
            w = np.asarray(self.task_weights, np.float64)
            if w.shape != (len(self.tasks),):
                raise TrainError(f"{len(self.task_weights)} task weights for {len(self.tasks)} tasks")
            if not (np.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
                raise TrainError(f"task weights must be finite, >= 0 and not all 0, got {list(self.task_weights)}")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["tasks"] = list(self.tasks)
        d["task_weights"] = None if self.task_weights is None else list(self.task_weights)
        d["eval_tasks"] = None if self.eval_tasks is None else list(self.eval_tasks)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "TrainConfig":
        d = dict(d)
        d["tasks"] = tuple(d["tasks"])
        for k in ("task_weights", "eval_tasks"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)


#: Named training settings: the fields of :class:`TrainConfig` each one changes from its defaults (which are
#: ``tiny_tasks``). ``tiny_long`` (issue #13): the long-answer tasks of :mod:`bench.tasks.long`, generation
#: length 128 (longest answer 99 characters + EOS) in blocks of 32, rows of 140 + 128 tokens (longest chat
#: prompt 139), batch 16, 6000 steps (~1 s a step on 2 idle cores). It starts from the ``tiny_tasks``
#: weights (same architecture and tokenizer) and trains on a length curriculum: the long tasks (weight 1),
#: the same formats on 7-14 names (``mid_*``, weight 0.5) and ``tiny_tasks``' six list tasks (3-6 names,
#: weight 0.25); it is evaluated on the long tasks only. Trained from random weights on the long tasks alone,
#: a first run sat at the loss of guessing names from the pool (no copying) from step 900 to 1800, and so did
#: a warm start without the medium lists. Half of its rows are block-structured (``block_mask_prob``, see the
#: module docstring): run 3, trained on independent masks alone, solved no long answer by step 4,100.
#: ``tiny_moe`` (issue #45): a 3-layer LLaDA-MoE (d_model 128, 4 heads, 8 experts of 64, top-2, q/k-norm,
#: 858,176 parameters, ~3.4 MB) from scratch on the six list tasks of ``tiny_tasks``, copy and reverse weighted
#: 3 (the easy tasks every cached decoder must answer; the others may stay weak), load-balancing weight 0.01
#: (the real LLaDA-MoE config's ``router_aux_loss_coef``), a quarter of the rows block-structured, batch 32:
#: small and short enough to train on a shared 2-core CPU within an hour.
_LIST_TASKS = ("copy", "reverse", "sort", "insert", "remove", "replace")
PRESETS: dict[str, dict] = {
    "tiny_tasks": {},
    "tiny_long": dict(preset="tiny_long", tasks=T.LONG_TASK_NAMES + T.MID_TASK_NAMES + _LIST_TASKS,
                      task_weights=((1.0,) * len(T.LONG_TASK_NAMES) + (0.5,) * len(T.MID_TASK_NAMES)
                                    + (0.25,) * len(_LIST_TASKS)),
                      eval_tasks=T.LONG_TASK_NAMES, init_from="tiny_tasks", steps=6000, batch=16,
                      gen_length=128, block_length=32, prompt_slot=140, max_sequence_length=384, lr=5e-4,
                      warmup=100, block_mask_prob=0.5),
    "tiny_moe": dict(preset="tiny_moe", family="llada_moe", n_layers=3, d_model=128, n_heads=4, mlp_hidden=64,
                     n_experts=8, top_k=2, aux_loss_coef=0.01, rope_theta=50000.0, tasks=_LIST_TASKS,
                     task_weights=(3.0, 3.0, 1.0, 1.0, 1.0, 1.0), steps=4500, batch=32, lr=2e-3, warmup=100,
                     block_mask_prob=0.25),
}


def preset_config(name: str, **overrides) -> TrainConfig:
    """The :class:`TrainConfig` of preset ``name`` with ``overrides`` (fields; ``None`` values are ignored);
    an invalid result raises :class:`TrainError`."""
    if name not in PRESETS:
        raise TrainError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    fields = dict(PRESETS[name])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return TrainConfig(**fields)


def model_config(tc: TrainConfig, tok: Tokenizer) -> ModelConfig:
    v = tok.vocab_size
    moe = (dict(family="llada_moe", moe=MoeConfig(n_experts=tc.n_experts, top_k=tc.top_k, qk_norm=True))
           if tc.family == "llada_moe" else {})
    cfg = ModelConfig(d_model=tc.d_model, n_heads=tc.n_heads, n_kv_heads=tc.n_heads, n_layers=tc.n_layers,
                      mlp_hidden_size=tc.mlp_hidden, vocab_size=v, embedding_size=v,
                      mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                      max_sequence_length=tc.max_sequence_length, rope_theta=tc.rope_theta, **moe)
    cfg.validate(tc.preset)
    return cfg


def family_module(tc: TrainConfig):
    """The model module of the run's family (:mod:`polestar_jax.models.llada` or ``llada_moe``)."""
    return MOE if tc.family == "llada_moe" else M


# ------------------------------------------------------------------------------------------------ data

@functools.lru_cache(maxsize=None)
def _chat_affixes(tok: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefix, suffix) ids of the chat template around a user text (checked against the template)."""
    marker = "\x00"
    ids = tok.chat_prompt_ids(marker)
    i = ids.index(0)
    pre, suf = tuple(ids[:i]), tuple(ids[i + 1:])
    probe = "copy: ann,bob"
    assert list(pre) + tok.encode(probe) + list(suf) == tok.chat_prompt_ids(probe)
    return pre, suf


def prompt_ids(tok: Tokenizer, prompt: str) -> list[int]:
    """Chat-template prompt ids of a task prompt (same as ``tok.chat_prompt_ids(prompt)``, faster)."""
    pre, suf = _chat_affixes(tok)
    return [*pre, *prompt.encode("utf-8"), *suf]


def answer_ids(tok: Tokenizer, answer: str, G: int) -> np.ndarray:
    """The answer region of a row: ``answer``'s byte tokens padded with EOS to ``G`` ([G] int32); the
    training target and the reference of :mod:`bench.probe_prefix`."""
    a = list(answer.encode("utf-8"))
    if len(a) > G:
        raise ValueError(f"instance too long for the layout (answer {len(a)} > {G})")
    return np.array(a + [tok.eos_token_id] * (G - len(a)), np.int32)


def make_batch(rng: np.random.Generator, tc: TrainConfig, tok: Tokenizer) -> tuple[dict, list[tuple[str, str, str]]]:
    """One training batch (numpy) drawn from ``rng`` and the (task, prompt, answer) of each row.

    ids [b, L] int32 (answer region holds the clean answer + EOS padding; pad = EOS elsewhere),
    valid [b, L] bool (key_valid), start [b] int32 (index of the first answer token).
    """
    rows = [T.sample_task(rng, tc.tasks, tc.task_weights) for _ in range(tc.batch)]
    return rows_batch(tok, tc, [(prompt, answer) for _, prompt, answer in rows]), rows


def rows_batch(tok: Tokenizer, tc: TrainConfig, pairs: Sequence[tuple[str, str]]) -> dict:
    """The training layout (:func:`make_batch`) of the clean (prompt, answer) ``pairs``: ids, valid [n, L],
    start [n]."""
    b, G, P = len(pairs), tc.gen_length, tc.prompt_slot
    ids = np.full((b, P + G), tok.eos_token_id, np.int32)
    valid = np.zeros((b, P + G), bool)
    start = np.zeros((b,), np.int32)
    for r, (prompt, answer) in enumerate(pairs):
        p = prompt_ids(tok, prompt)
        if len(p) > P:
            raise ValueError(f"instance too long for the layout (prompt {len(p)} > {P})")
        n = len(p)
        ids[r, :n] = p
        ids[r, n:n + G] = answer_ids(tok, answer, G)
        valid[r, :n + G] = True
        start[r] = n
    return {"ids": ids, "valid": valid, "start": start}


# ------------------------------------------------------------------------------------------------ model

def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, max(1, tc.warmup), max(tc.steps, tc.warmup + 1),
                                               end_value=tc.lr * tc.end_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(sched, b1=0.9, b2=tc.b2, weight_decay=tc.weight_decay))


def init_params(tc: TrainConfig, mcfg: ModelConfig) -> dict:
    """Initial parameters from ``numpy.random.default_rng(seed)`` in the layout of ``polestar_jax.models.llada``:
    normal with std ``init_std`` for linear layers, 1 for the embedding, ones for the norms (numpy, so no
    compilation is spent on initialisation)."""
    shapes = param_shapes(mcfg)
    rng = np.random.default_rng([tc.seed, 0x1A1DA])

    def make(path, shape):
        name = path[-1].key
        if name in ("attn_norm", "ff_norm", "ln_f", "q_norm", "k_norm"):
            return jnp.ones(shape, jnp.float32)
        std = 1.0 if name == "wte" else tc.init_std
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    return jax.tree_util.tree_map_with_path(make, shapes, is_leaf=lambda x: isinstance(x, tuple))


def start_params(tc: TrainConfig, mcfg: ModelConfig) -> dict:
    """The weights of ``tc.init_from`` (float32; their shapes must be ``mcfg``'s), or :func:`init_params`."""
    if tc.init_from is None:
        return init_params(tc, mcfg)
    from polestar_jax.io.checkpoint import load_model

    path = tc.init_from if os.path.isdir(tc.init_from) else asset_model_dir(tc.init_from)
    _, params = load_model(path, dtype="float32")
    want = jax.tree.map(tuple, param_shapes(mcfg), is_leaf=lambda x: isinstance(x, tuple))
    got = jax.tree.map(lambda x: tuple(x.shape), params)
    if got != want:
        raise TrainError(f"--init-from {tc.init_from}: parameter shapes differ from this configuration's")
    return params


def init_state(tc: TrainConfig, mcfg: ModelConfig) -> dict:
    """Start params (:func:`start_params`), optimizer state (zeros) and step 0."""
    params = start_params(tc, mcfg)
    opt_shapes = jax.eval_shape(make_optimizer(tc).init, params)
    opt_state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), opt_shapes)
    return {"params": params, "opt_state": opt_state, "step": jnp.int32(0)}


class AnswerMask(NamedTuple):
    """The noise of one batch: which answer tokens are masked and how each row's loss is normalised."""

    masked: jax.Array  # [b, G] bool
    t: jax.Array  # [b] masking rate of the row (of its current block in a block-structured row)
    structured: jax.Array  # [b] bool: block-structured row (mean over masked tokens) vs independent (1/t)


def answer_mask(key: jax.Array, b: int, G: int, eps: float, block_length: int, block_mask_prob: float) -> AnswerMask:
    """Draws the masks of ``b`` answers of length ``G`` (see the module docstring). With
    ``block_mask_prob == 0`` the draws are those of independent masking alone (runs before the option existed
    replay unchanged)."""
    k_t, k_m = jax.random.split(key)
    t = (1.0 - eps) * jax.random.uniform(k_t, (b,)) + eps  # [b]
    u = jax.random.uniform(k_m, (b, G))  # [b, G]
    masked = u < t[:, None]
    structured = jnp.zeros((b,), bool)
    if block_mask_prob > 0.0:
        k_s, k_j = jax.random.split(jax.random.fold_in(key, 0xB10C))
        structured = jax.random.uniform(k_s, (b,)) < block_mask_prob
        c = block_length * jax.random.randint(k_j, (b, 1), 0, G // block_length)  # [b, 1] block start
        p = jnp.arange(G, dtype=jnp.int32)[None]
        in_block = (p >= c) & (p < c + block_length)
        blocky = (p >= c + block_length) | (in_block & masked)
        masked = jnp.where(structured[:, None], blocky, masked)
    return AnswerMask(masked, t, structured)


def balance_loss(router: jax.Array, xn: jax.Array, valid: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """The load-balancing loss of one MoE layer (Switch Transformer / OLMoE form, what the reference's
    ``router_aux_loss_coef`` weighs): ``E * sum_e f_e * P_e`` over the valid tokens, with ``f_e`` the share of
    the top-k assignments that go to expert ``e`` and ``P_e`` its mean router probability. 1 when routing is
    uniform, up to ``E`` when one expert takes everything; its gradient reaches the router through ``P``.

    router [D, E]; xn [b, T, D] the normed rows the router sees; valid [b, T] bool. Returns the loss (float32
    scalar) and the shares ``f`` [E] (sum 1)."""
    e = router.shape[-1]
    x = xn.reshape(-1, xn.shape[-1])  # [M, D]
    w = valid.reshape(-1).astype(jnp.float32)  # [M]
    logits, idx, _ = MOE.route(router, x, top_k)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [M, E]
    n = jnp.maximum(jnp.sum(w), 1.0)
    share = jnp.einsum("m,mke->e", w, jax.nn.one_hot(idx, e, dtype=jnp.float32)) / (n * top_k)  # [E]
    mean_p = jnp.einsum("m,me->e", w, probs) / n  # [E]
    return e * jnp.sum(share * mean_p), share


def dense_experts(lp: dict, xn: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The family's MoE block (:func:`polestar_jax.models.llada_moe.moe_mlp`: the same router, the raw top-k
    weights, SwiGLU experts) computed densely, for training on a CPU: every expert on every row, mixed with the
    top-k weights (0 for the other experts). The same function to rounding; on the CPU, where
    ``jax.lax.ragged_dot`` lowers to a masked product over all E groups for each of the M*k assignments,
    this is k times fewer FLOPs (forward and backward). xn [b, T, D] -> [b, T, D]."""
    b, t, d = xn.shape
    x = xn.reshape(b * t, d)  # [M, D]
    _, idx, weight = MOE.route(lp["router"], x, cfg.moe.top_k)  # [M, k] each
    gates = jnp.sum(jax.nn.one_hot(idx, cfg.moe.n_experts, dtype=x.dtype) * weight[..., None], axis=1)  # [M, E]
    hid = jax.nn.silu(jnp.einsum("md,edf->emf", x, lp["e_gate"])) * jnp.einsum("md,edf->emf", x, lp["e_up"])
    y = jnp.einsum("emf,efd->emd", hid, lp["e_down"])  # [E, M, D]
    return jnp.einsum("emd,me->md", y, gates).reshape(b, t, d)


def moe_forward(params, ids: jax.Array, mcfg: ModelConfig, pos: jax.Array, valid: jax.Array):
    """``llada_moe.forward(params, ids, mcfg, pos, pos, valid).h`` [b, L, D] (the family's own layer, run over
    the layers here so that each layer's router input is at hand; its MoE block as :func:`dense_experts`),
    the mean :func:`balance_loss` of the layers (scalar) and each layer's expert shares [N, E] over the valid
    tokens."""
    rope = M.Rope.at(pos, mcfg)

    def body(h, lp):
        seen = []

        def mlp(lp_, xn, cfg_):  # the family's MoE block; keeps its input for the balance loss
            seen.append(xn)
            return dense_experts(lp_, xn, cfg_)

        out = MOE.layer(lp, h, mcfg, rope, rope, valid, mlp=mlp)
        return out.h, balance_loss(lp["router"], seen[0], valid, mcfg.moe.top_k)

    h, (aux, share) = lax.scan(body, M.embed(params, ids), params["blocks"])
    return h, jnp.mean(aux), share


def loss_fn(params, batch: dict, key: jax.Array, mcfg: ModelConfig, tc: "TrainConfig"):
    """The training loss (scalar: LLaDA's SFT loss, plus ``aux_loss_coef`` times the load-balancing loss of
    an MoE run) and (the per-row SFT loss [b], the balance loss: 0 for a dense model)."""
    ids, valid, start = batch["ids"], batch["valid"], batch["start"]
    b, L = ids.shape
    G = tc.gen_length
    noise = answer_mask(key, b, G, tc.eps, tc.block_length, tc.block_mask_prob)
    masked, t = noise.masked, noise.t
    ans_idx = start[:, None] + jnp.arange(G, dtype=jnp.int32)[None]  # [b, G]
    answer = jnp.take_along_axis(ids, ans_idx, axis=1)
    rows = jnp.arange(b)[:, None]
    noisy = ids.at[rows, ans_idx].set(jnp.where(masked, mcfg.mask_token_id, answer))
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (b, L))
    if mcfg.moe is not None:
        h, aux, _ = moe_forward(params, noisy, mcfg, pos, valid)  # [b, L, D], scalar
    else:
        h, aux = M.forward(params, noisy, mcfg, pos, pos, valid).h, jnp.float32(0.0)
    h_ans = jnp.take_along_axis(h, ans_idx[..., None], axis=1)  # [b, G, D]
    logits = M.lm_head(params, h_ans, mcfg)  # [b, G, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(logp, answer[..., None], axis=-1)[..., 0]  # [b, G]
    total = jnp.sum(jnp.where(masked, ce, 0.0), axis=1)  # [b]
    n_masked = jnp.maximum(jnp.sum(masked, axis=1), 1)
    row = jnp.where(noise.structured, total / n_masked, total / t / G)  # [b]
    return jnp.mean(row) + tc.aux_loss_coef * aux, (row, aux)


@functools.lru_cache(maxsize=8)
def make_train_step(tc: TrainConfig, mcfg: ModelConfig):
    """The jitted ``step(state, batch) -> (state, loss, row_loss, grad_norm, balance_loss)`` of this
    configuration."""
    tx = make_optimizer(tc)
    base_key = jax.random.PRNGKey(tc.seed)

    def step(state, batch):
        key = jax.random.fold_in(jax.random.fold_in(base_key, 1), state["step"])
        (loss, (row, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], batch, key, mcfg, tc)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        return new, loss, row, optax.tree.norm(grads), aux

    return jax.jit(step, donate_argnums=(0,))


# ------------------------------------------------------------------------------------------------ eval

def evaluate(params, mcfg: ModelConfig, tok: Tokenizer, n_per_task: int, tc: TrainConfig,
             tasks: Optional[Sequence[str]] = None, eval_batch: int = 144, start: int = 0,
             return_outputs: bool = False, engine=None):
    """Exact match per task on evaluation instances ``start..start+n-1`` (held-out seeds) with the
    one-token-per-step sampler (``llada``, ``steps = gen_length``, block ``block_length``). ``engine``: a
    :class:`polestar_jax.engine.engine.Engine` of this model's shapes to reuse (its compiled programs) across
    evaluations; default: a new one."""
    from polestar_jax.engine.engine import Engine

    engine = engine or Engine(params, mcfg, tok)

    tasks = tuple(tasks or tc.eval_tasks or tc.tasks)
    items = [(task, p, a) for task in tasks for p, a in T.eval_instances(task, n_per_task, start)]
    dcfg = DecodeConfig(decoder="llada", cache="none", gen_length=tc.gen_length,
                        block_length=tc.block_length, steps=tc.gen_length, threshold=None)
    slot = -(-tc.prompt_slot // 16) * 16
    outputs: list[str] = []
    eval_batch = min(eval_batch, len(items))
    for i in range(0, len(items), eval_batch):
        chunk = items[i:i + eval_batch]
        prompts = [prompt_ids(tok, p) for _, p, _ in chunk]
        prompts += [prompts[0]] * (eval_batch - len(prompts))  # one shape: one compiled executable
        res = engine.run(prompts, dcfg, seed=0, prompt_slot=slot, params=params)
        outputs += [T.decode_answer(tok, res.row(r).tokens) for r in range(len(chunk))]
    hits: dict[str, list[bool]] = defaultdict(list)
    for (task, p, _), out in zip(items, outputs):
        hits[task].append(T.score(task, p, out))
    acc = {task: float(np.mean(hits[task])) for task in tasks}
    if return_outputs:
        return acc, list(zip(items, outputs))
    return acc


def expert_use(params, mcfg: ModelConfig, tok: Tokenizer, tc: TrainConfig, n_per_task: int) -> np.ndarray:
    """Each layer's share of the top-k assignments per expert [N, E] (rows sum to 1) over the prompt and
    clean answer tokens of the first ``n_per_task`` held-out instances of each evaluation task."""
    pairs = [pa for task in (tc.eval_tasks or tc.tasks) for pa in T.eval_instances(task, n_per_task)]
    batch = rows_batch(tok, tc, pairs)
    pos = jnp.broadcast_to(jnp.arange(batch["ids"].shape[1], dtype=jnp.int32), batch["ids"].shape)
    _, _, share = jax.jit(moe_forward, static_argnums=2)(params, batch["ids"], mcfg, pos, batch["valid"])
    return np.asarray(share)


# ------------------------------------------------------------------------------------------------ ckpt

def _ckpt_manager(out: str):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(out), options=ocp.CheckpointManagerOptions(
        max_to_keep=2, create=True, enable_async_checkpointing=False))


def _rng_state_to_json(rng: np.random.Generator) -> dict:
    return json.loads(json.dumps(rng.bit_generator.state, default=str), parse_int=str)


def _rng_from_json(d: dict) -> np.random.Generator:
    st = d
    rng = np.random.default_rng()
    rng.bit_generator.state = {"bit_generator": st["bit_generator"],
                               "state": {k: int(v) for k, v in st["state"].items()},
                               "has_uint32": int(st["has_uint32"]), "uinteger": int(st["uinteger"])}
    return rng


def save(mngr, state: dict, meta: dict) -> None:
    import orbax.checkpoint as ocp

    step = int(state["step"])
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
              force=True)
    mngr.wait_until_finished()


def restore(mngr, like_state: dict, step: Optional[int] = None) -> tuple[dict, dict]:
    import orbax.checkpoint as ocp

    step = mngr.latest_step() if step is None else step
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]


# ------------------------------------------------------------------------------------------------ train

def _log(msg: str, log=None) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if log is not None:
        log.write(line + "\n")
        log.flush()


def train(tc: TrainConfig, out: str, resume: bool = False, max_minutes: Optional[float] = None,
          save_every: int = 250, eval_every: int = 500, eval_n: int = 32, log_every: int = 25,
          command: Optional[str] = None, stop_at: Optional[int] = None, verbose: bool = True) -> dict:
    """Trains up to ``tc.steps`` (or ``stop_at``, for tests: stop and save there). Returns a dict with
    ``state`` (params, opt_state, step), ``meta`` (as saved) and ``losses`` ({step: loss} of this run)."""
    tok = load_tokenizer(asset_model_dir(TOKENIZER_SOURCE))
    mcfg = model_config(tc, tok)
    mngr = _ckpt_manager(out)
    if mngr.latest_step() is not None:
        if not resume:
            raise TrainError(f"{out} already holds a checkpoint (step {mngr.latest_step()}); pass --resume "
                             f"to continue it or choose another --out")
        # the restore target: random weights of the same shapes (init_from only defines step 0, which the
        # checkpoint holds, so its folder need not exist any more)
        state, meta = restore(mngr, init_state(dataclasses.replace(tc, init_from=None), mcfg))
        # as fresh (uncommitted) arrays, so the compiled step of a fresh start is reused
        state = jax.tree.map(jnp.asarray, jax.device_get(state))
        saved = TrainConfig.from_json(meta["train_config"])
        if dataclasses.replace(saved, steps=tc.steps, init_from=tc.init_from) != tc:
            diff = {k: (v, getattr(tc, k)) for k, v in dataclasses.asdict(saved).items()
                    if k not in ("steps", "init_from") and v != getattr(tc, k)}
            raise TrainError(f"--resume: the configuration differs from the checkpoint's: {diff}")
        tc = dataclasses.replace(tc, init_from=saved.init_from)
        rng = _rng_from_json(meta["rng_state"])
        meta["train_config"] = tc.to_json()
    else:
        state = init_state(tc, mcfg)
        rng = T.train_rng(tc.seed)
        meta = {"train_config": tc.to_json(), "train_seconds": 0.0, "history": [], "evals": [], "commands": []}
    meta["commands"].append(command or "")
    step_fn = make_train_step(tc, mcfg)
    stop = tc.steps if stop_at is None else min(stop_at, tc.steps)
    step = int(state["step"])
    say = (lambda m: _log(m)) if verbose else (lambda m: None)
    if step > 0:
        say(f"resumed from {out} at step {step} (trained {meta['train_seconds'] / 60:.1f} min so far)")
    say(f"model: {family_module(tc).__name__} {tc.n_layers}L d{tc.d_model} h{tc.n_heads} mlp{tc.mlp_hidden} vocab {mcfg.vocab_size}, "
        f"{sum(x.size for x in jax.tree.leaves(state['params'])):,} params; batch {tc.batch}, "
        f"rows {tc.prompt_slot}+{tc.gen_length}; steps {step} -> {stop}")
    losses: dict[int, float] = {}
    pending = []  # (step, loss, row, gnorm, tasks, balance loss) device values not yet read
    t_run = time.perf_counter()
    t_last, n_last = t_run, step
    secs0 = meta["train_seconds"]

    def flush():
        nonlocal pending
        if not pending:
            return
        vals = jax.device_get([(l, r, g, a) for _, l, r, g, _, a in pending])
        by_task: dict[str, list[float]] = defaultdict(list)
        for (s, _, _, _, names, _), (l, r, g, _) in zip(pending, vals):
            losses[s] = float(l)
            for name, x in zip(names, r):
                by_task[name].append(float(x))
        ls = [float(v[0]) for v in vals]
        gs = [float(v[2]) for v in vals]
        rec = {"step": pending[-1][0] + 1, "loss": float(np.mean(ls)), "grad_norm": float(np.mean(gs)),
               "task_loss": {k: round(float(np.mean(v)), 4) for k, v in sorted(by_task.items())}}
        if tc.family == "llada_moe":
            rec["balance_loss"] = round(float(np.mean([float(v[3]) for v in vals])), 4)
        pending = []
        return rec

    eval_engine = None
    while step < stop:
        batch, rows = make_batch(rng, tc, tok)
        state, loss, row, gnorm, aux = step_fn(state, batch)
        pending.append((step, loss, row, gnorm, [r[0] for r in rows], aux))
        step += 1
        elapsed = time.perf_counter() - t_run
        out_of_time = max_minutes is not None and elapsed > 60 * max_minutes
        if step % log_every == 0 or step == stop or out_of_time or step % save_every == 0:
            rec = flush()
            now = time.perf_counter()
            rec["s_per_step"] = round((now - t_last) / max(1, step - n_last), 4)
            t_last, n_last = now, step
            rec["minutes"] = round((secs0 + now - t_run) / 60, 2)
            meta["history"].append(rec)
            tl = " ".join(f"{k}={v:.3f}" for k, v in rec["task_loss"].items())
            bal = f" balance {rec['balance_loss']:.3f}" if "balance_loss" in rec else ""
            say(f"step {step:6d} loss {rec['loss']:.4f}{bal} gnorm {rec['grad_norm']:.2f} "
                f"{rec['s_per_step']:.3f}s/step {rec['minutes']:.1f}min | {tl}")
        if eval_every and (step % eval_every == 0 or step == stop) and eval_n > 0:
            t0 = time.perf_counter()
            if eval_engine is None:
                from polestar_jax.engine.engine import Engine

                eval_engine = Engine(state["params"], mcfg, tok)  # its programs serve every evaluation
            acc = evaluate(state["params"], mcfg, tok, eval_n, tc, engine=eval_engine)
            meta["evals"].append({"step": step, "n_per_task": eval_n, "acc": acc})
            say(f"eval step {step} ({eval_n}/task, {time.perf_counter() - t0:.0f}s): "
                + " ".join(f"{k}={v:.2f}" for k, v in acc.items()))
            t_last = time.perf_counter()  # s/step excludes evaluation
        if step % save_every == 0 or step == stop or out_of_time:
            meta["train_seconds"] = secs0 + (time.perf_counter() - t_run)
            meta["rng_state"] = _rng_state_to_json(rng)
            save(mngr, state, meta)
            say(f"saved step {step} to {out}")
            t_last = time.perf_counter()
        if out_of_time:
            say(f"stopping after {max_minutes} minutes at step {step}; continue with --resume")
            break
    if pending:
        flush()
    if (mngr.latest_step() or 0) < step:
        meta["train_seconds"] = secs0 + (time.perf_counter() - t_run)
        meta["rng_state"] = _rng_state_to_json(rng)
        save(mngr, state, meta)
    mngr.close()
    return {"state": state, "meta": meta, "losses": losses, "mcfg": mcfg, "tok": tok}


def load_checkpoint(out: str, step: Optional[int] = None) -> tuple[dict, TrainConfig]:
    """The checkpoint of ``out`` (latest, or ``step``) as a training result (``state``, ``meta``, ``mcfg``,
    ``tok``) and its :class:`TrainConfig`, without training; the folder is only read (another process may
    still be training into it)."""
    import orbax.checkpoint as ocp

    mngr = _ckpt_manager(out)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise TrainError(f"{out} holds no checkpoint")
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    tc = TrainConfig.from_json(meta["train_config"])
    tok = load_tokenizer(asset_model_dir(TOKENIZER_SOURCE))
    mcfg = model_config(tc, tok)
    like = jax.eval_shape(lambda: init_state(tc, mcfg))
    state, meta = restore(mngr, like, step)
    mngr.close()
    return {"state": state, "meta": meta, "losses": {}, "mcfg": mcfg, "tok": tok}, tc


# ------------------------------------------------------------------------------------------------ export

def export(result: dict, tc: TrainConfig, out_dir: str, eval_n: int = 200) -> dict:
    """Writes the HF folder ``out_dir`` and evaluates the model loaded back from it."""
    from polestar_jax.io.checkpoint import copy_aux_files, export_hf, load_model

    mcfg, tok, meta = result["mcfg"], result["tok"], result["meta"]
    params = result["state"]["params"]
    os.makedirs(out_dir, exist_ok=True)
    extra = {"bos_token_id": tok.bos_token_id}
    if mcfg.moe is not None:  # the weight of the load-balancing loss it was trained with (the HF key)
        extra["router_aux_loss_coef"] = tc.aux_loss_coef
    export_hf(out_dir, mcfg, jax.device_get(params), extra_config=extra)
    copy_aux_files(asset_model_dir(TOKENIZER_SOURCE), out_dir,
                   names=("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                          "generation_config.json"))
    # the decoding lengths the model was trained for: the CLI and bench.run default to them
    gc_path = os.path.join(out_dir, "generation_config.json")
    with open(gc_path) as f:
        gcfg = json.load(f)
    gcfg.update(gen_length=tc.gen_length, block_length=tc.block_length, steps=tc.gen_length)
    with open(gc_path, "w") as f:
        json.dump(gcfg, f, indent=2, sort_keys=True)
        f.write("\n")
    tc_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(tc_path) as f:
        tcfg = json.load(f)
    tcfg["model_max_length"] = mcfg.max_sequence_length
    with open(tc_path, "w") as f:
        json.dump(tcfg, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    cfg2, params2 = load_model(out_dir)
    tok2 = load_tokenizer(out_dir)
    assert cfg2 == mcfg, (cfg2, mcfg)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    t0 = time.perf_counter()
    acc = evaluate(params2, cfg2, tok2, eval_n, tc)
    eval_s = time.perf_counter() - t0
    use = expert_use(params2, cfg2, tok2, tc, 32) if cfg2.moe is not None else None
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(_readme(tc, mcfg, meta, acc, eval_n, eval_s, int(result["state"]["step"]),
                        sum(x.size for x in jax.tree.leaves(params)), use))
    return acc


def _readme(tc: TrainConfig, mcfg: ModelConfig, meta: dict, acc: dict, eval_n: int, eval_s: float,
            step: int, n_params: int, use: Optional[np.ndarray] = None) -> str:
    cmds = "\n".join(c for c in meta.get("commands", []) if c)
    rows = "\n".join(f"| {k} | {acc[k] * 100:.1f}% | {T.TASKS[k].doc} |" for k in acc)
    last = meta["history"][-1] if meta.get("history") else {}
    long, moe = tc.preset == "tiny_long", tc.family == "llada_moe"
    title = ("tiny_long: a tiny LLaDA trained on long-answer list tasks" if long else
             f"{tc.preset}: a tiny LLaDA-MoE trained on synthetic list tasks" if moe else
             "tiny_tasks: a tiny LLaDA trained on synthetic list and arithmetic tasks")
    issue = "issue #13" if long else "issue #45" if moe else "issue #6"
    bed = ("the long-answer test bed (answers of 55-99 tokens, several 32-token blocks)" if long
           else "the mixture-of-experts test bed for decoder accuracy versus speed" if moe
           else "the test bed for decoder accuracy versus speed")
    arch = (f"LLaDA-MoE-architecture model (`LLaDAMoEModelLM`: d_model {tc.d_model}, {tc.n_heads} heads with "
            f"q/k-norm, {tc.n_experts} SwiGLU experts of {tc.mlp_hidden} per layer, top-{tc.top_k} routing"
            if moe else f"LLaDA-architecture model (d_model {tc.d_model}, {tc.n_heads} heads, MLP {tc.mlp_hidden}")
    objective = ("LLaDA's SFT objective plus the load-balancing loss (weight "
                 f"{tc.aux_loss_coef:g}, `bench.train_tiny.balance_loss`)" if moe else "LLaDA's SFT objective")
    formats = "bench/tasks/long.py" if long else "bench/tasks/__init__.py"
    # an export of a step before the end of its schedule says so (the lr never reached its floor)
    mid = step < tc.steps
    sched = f" (schedule: {tc.steps:,} steps)" if mid else ""
    end_at = f" at step {tc.steps:,}" if mid else ""
    return f"""# {title}

A {tc.n_layers}-layer {arch},
{n_params:,} float32 parameters) with the byte-level tokenizer and LLaDA chat template of `tiny_random`,
trained {'from scratch' if tc.init_from is None else f'from the weights of `{tc.init_from}`'} on CPU by
`bench/train_tiny.py` with {objective} on the tasks of `bench/tasks` ({issue}). It is {bed}.

* Generation length **{tc.gen_length}** (answers padded with `<|endoftext|>`), block length {tc.block_length}.
  Decode with `--gen-length {tc.gen_length} --block-length {tc.block_length}`; other lengths were never trained.
* Prompts: the chat-template rendering of a task prompt (e.g. `reverse: bob,eve,tom`); the answer is the
  text before the first `<|endoftext|>` (`bench.tasks.decode_answer`).
* Training: {step} steps{sched} of batch {tc.batch}, AdamW (peak lr {tc.lr}, warmup {tc.warmup}, cosine to
  {tc.lr * tc.end_lr_ratio:g}{end_at}, weight decay {tc.weight_decay}, clip {tc.clip}), seed {tc.seed},
  tasks {', '.join(tc.tasks)} mixed {'uniformly' if tc.task_weights is None else f'with weights {list(tc.task_weights)}'};
  {'independent masks only' if tc.block_mask_prob == 0 else f'{tc.block_mask_prob:g} of the rows with block-structured masks (clean blocks, the current block at rate t, masked blocks: the states a block decoder meets)'};
  {meta.get('train_seconds', 0) / 60:.0f} minutes of training on a {os.cpu_count()}-core CPU; final training loss
  {last.get('loss', float('nan')):.4f}.

Command(s):

```
{cmds}
```

## Accuracy

Exact match on {eval_n} held-out instances per task (evaluation seeds >= {T.EVAL_SEED_BASE:,}, never trained on),
with the one-token-per-step sampler (`decoder=llada`, steps = gen length = {tc.gen_length}, block {tc.block_length}),
evaluated on the exported folder ({eval_s:.0f} s):

| task | exact match | |
|---|---|---|
{rows}

Task formats are documented in `{formats}`.
{_use_section(use, tc)}"""


def _use_section(use: Optional[np.ndarray], tc: TrainConfig) -> str:
    """The README's expert-use table (MoE runs; empty otherwise)."""
    if use is None:
        return ""
    head = " | ".join(str(e) for e in range(use.shape[1]))
    rows = "\n".join(f"| {i} | " + " | ".join(f"{100 * x:.0f}%" for x in r) + " |" for i, r in enumerate(use))
    return f"""
## Expert use

Share of the top-{tc.top_k} assignments that each expert receives, per layer, over the prompt and clean answer
tokens of the first 32 held-out instances of each task above (`bench.train_tiny.expert_use`; uniform routing
would give {100 / use.shape[1]:.1f}% each):

| layer | {head} |
|---|{'---|' * use.shape[1]}
{rows}
"""


# ------------------------------------------------------------------------------------------------ CLI

def _saved_config(out: str) -> Optional[TrainConfig]:
    """The configuration of the latest checkpoint in ``out`` (None when it holds none); only reads."""
    import orbax.checkpoint as ocp

    if not os.path.isdir(out):
        return None
    mngr = _ckpt_manager(out)
    try:
        step = mngr.latest_step()
        if step is None:
            return None
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        return TrainConfig.from_json(meta["train_config"])
    finally:
        mngr.close()


def parse_task_weights(spec: str, base: TrainConfig) -> tuple[float, ...]:
    """The task weights of ``base`` (its own, else 1 each) with the ``task=weight`` items of the
    comma-separated ``spec`` changed, in ``base.tasks`` order; a malformed item, a task outside ``base.tasks``
    or a negative or non-finite weight raises a one-line :class:`TrainError`."""
    weights = dict(zip(base.tasks, base.task_weights or (1.0,) * len(base.tasks)))
    for item in spec.split(","):
        task, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not task:
            raise TrainError(f"--task-weights item {item!r} is not task=weight")
        if task not in weights:
            raise TrainError(f"--task-weights: {task!r} is not a task of this run ({', '.join(base.tasks)})")
        try:
            w = float(value)
        except ValueError:
            raise TrainError(f"--task-weights: weight {value!r} of {task} is not a number") from None
        if not (np.isfinite(w) and w >= 0):
            raise TrainError(f"--task-weights: weight of {task} must be finite and >= 0, got {value}")
        weights[task] = w
    return tuple(weights[t] for t in base.tasks)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (see the module docstring): 0 when done, 2 with one ``error:`` line for bad input."""
    return cli.report_errors(_main, argv)


def _main(argv: Optional[Sequence[str]]) -> None:
    ap = cli.Parser(prog="python -m bench.train_tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint folder (orbax CheckpointManager)")
    ap.add_argument("--preset", choices=tuple(PRESETS), default=None,
                    help="named setting (default tiny_tasks; with --resume: the checkpoint's)")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"total training steps (default {TrainConfig.steps}, tiny_long {PRESETS['tiny_long']['steps']})")
    ap.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    ap.add_argument("--seed", type=int, default=None, help="data and masking seed (default 0)")
    # the defaults of these (and of --seed) come from the preset (TrainConfig's for tiny_tasks); with --resume
    # from the checkpoint's configuration, which a given flag must match (only --steps may change)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--end-lr-ratio", type=float, default=None)
    ap.add_argument("--block-mask-prob", type=float, default=None,
                    help=f"share of block-structured masks (default {TrainConfig.block_mask_prob}, tiny_long "
                         f"{PRESETS['tiny_long']['block_mask_prob']})")
    ap.add_argument("--gen-length", type=int, default=None)
    ap.add_argument("--block-length", type=int, default=None)
    ap.add_argument("--prompt-slot", type=int, default=None)
    ap.add_argument("--task-weights", default=None,
                    help="comma-separated task=weight (others: the preset's, else 1), e.g. reverse=2,add=1.5")
    ap.add_argument("--init-from", default=None,
                    help="start from these weights (a bundled asset name or a model folder of the same shapes)")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (and save) after this many minutes")
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-n", type=int, default=32, help="held-out instances per task for periodic evals")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--export", default=None, help="after training, write an HF model folder here")
    ap.add_argument("--export-eval-n", type=int, default=200)
    ap.add_argument("--export-only", action="store_true",
                    help="export the latest checkpoint of --out (read only, no training; its own config)")
    args = ap.parse_args(argv)
    if args.export_only:
        if not args.export:
            raise TrainError("--export-only needs --export DIR")
        res, tc = load_checkpoint(args.out)
        acc = export(res, tc, args.export, args.export_eval_n)
        _log(f"exported step {int(res['state']['step'])} of {args.out} to {args.export}: "
             + " ".join(f"{k}={v:.3f}" for k, v in acc.items()))
        return

    saved = _saved_config(args.out) if args.resume else None
    if saved is not None:  # a resume: the checkpoint's configuration, with the flags given on top
        if args.init_from is not None:
            raise TrainError("--init-from only chooses the weights a run starts from; --resume continues the "
                             f"checkpoint in {args.out} (its starting weights are part of it)")
        if args.preset is not None and args.preset != saved.preset:
            raise TrainError(f"--preset {args.preset}: the checkpoint in {args.out} is a {saved.preset} run")
        base = saved

        def build(**fields) -> TrainConfig:
            return dataclasses.replace(saved, **{k: v for k, v in fields.items() if v is not None})
    else:
        preset = args.preset or "tiny_tasks"
        base = preset_config(preset)
        build = functools.partial(preset_config, preset)
    weights = parse_task_weights(args.task_weights, base) if args.task_weights else None
    tc = build(seed=args.seed, steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup,
               end_lr_ratio=args.end_lr_ratio, gen_length=args.gen_length, block_length=args.block_length,
               prompt_slot=args.prompt_slot, task_weights=weights, init_from=args.init_from,
               block_mask_prob=args.block_mask_prob)
    command = "python -m bench.train_tiny " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    res = train(tc, args.out, resume=args.resume, max_minutes=args.max_minutes, save_every=args.save_every,
                eval_every=args.eval_every, eval_n=args.eval_n, log_every=args.log_every, command=command)
    if args.export:
        tc = TrainConfig.from_json(res["meta"]["train_config"])  # a resumed run's own init_from
        if int(res["state"]["step"]) < tc.steps:
            _log(f"note: exporting at step {int(res['state']['step'])} < --steps {tc.steps}")
        acc = export(res, tc, args.export, args.export_eval_n)
        _log(f"exported to {args.export}: " + " ".join(f"{k}={v:.3f}" for k, v in acc.items()))


if __name__ == "__main__":
    sys.exit(main())
