"""Trains the tiny LLaDA-V of issue #46 item 5 (``tiny_vision``) on the image tasks of :mod:`bench.tasks.shapes`
(CPU, optax, orbax), and exports it as an HF LLaDA-V folder.

What is trained is what the engine runs: every row's picture goes through the family's own path, the
official ``anyres`` pixels (:func:`polestar_jax.models.image.preprocess`), the SigLIP tower and ``mlp2x_gelu``
projector (:func:`polestar_jax.models.vision.encode`), the splicing (:func:`polestar_jax.models.llada_v.image_rows`)
and the LM over the spliced prompt (:func:`polestar_jax.models.llada_v.forward`, which reads the image rows from
``params["image_rows"]`` as the decoders do); the prompt is the user path's (:func:`polestar_jax.io.images.
image_prompt_ids`: LLaDA-V's system message, ``<image>\\n`` before the question, the chat template of the
byte-level ``tiny_random`` tokenizer). All of the tower, projector, newline row and LM are trained together.

Objective, masks, optimizer and checkpoints are :mod:`bench.train_tiny`'s: LLaDA's SFT loss over the answer
(padded with EOS to ``gen_length``), a share ``block_mask_prob`` of block-structured masks
(:func:`bench.train_tiny.answer_mask`), AdamW with warmup and cosine decay, an orbax ``CheckpointManager`` in
``--out`` (params, optimizer state, step, the numpy data-RNG state and the log), ``--resume`` and
``--max-minutes``.

The model is small enough to learn on a shared 2-core CPU in well under an hour: the crop stays LLaDA-V's 384
pixels (hard-coded by the official processor) but the patch is 96 pixels (4 x 4 patches a crop), the only
grid is ``1x1`` (a 384-pixel picture is 2 crops and 16 + 4 * 5 = 36 image rows), the tower has one layer of
width 24, the LM 3 layers of width 64.

Usage::

    nice -n 10 python -m bench.train_vision --out /work/vision_ckpt [--resume] [--max-minutes 45]
    python -m bench.train_vision --out /work/vision_ckpt --export-only --export polestar_jax/assets/tiny_vision
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time
from collections import defaultdict
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import train_tiny as TT  # noqa: E402
from bench.tasks import decode_answer  # noqa: E402
from bench.tasks import shapes as S  # noqa: E402
from polestar_jax import cli  # noqa: E402
from polestar_jax.config import DecodeConfig, ModelConfig, VisionConfig  # noqa: E402
from polestar_jax.io import images as io_images  # noqa: E402
from polestar_jax.io.checkpoint import param_shapes  # noqa: E402
from polestar_jax.io.tokenizer import Tokenizer, asset_model_dir, load_tokenizer  # noqa: E402
from polestar_jax.models import image as img  # noqa: E402
from polestar_jax.models import llada_v as V  # noqa: E402
from polestar_jax.models import vision  # noqa: E402

TrainError = TT.TrainError
TOKENIZER_SOURCE = TT.TOKENIZER_SOURCE

__all__ = ["VisionTrainConfig", "model_config", "prompt", "make_batch", "loss_fn", "make_train_step", "train",
           "evaluate", "export", "main"]


@dataclasses.dataclass(frozen=True)
class VisionTrainConfig:
    """Everything that defines a ``tiny_vision`` run (saved in the checkpoint; a resume must match it, except
    ``steps``). The optimizer and mask fields mean what they mean in :class:`bench.train_tiny.TrainConfig`."""

    seed: int = 0
    steps: int = 2500
    batch: int = 16
    gen_length: int = 24  # longest answer 22 characters ("three purple triangles") + EOS padding
    block_length: int = 8
    # LM
    n_layers: int = 3
    d_model: int = 64
    n_heads: int = 4
    mlp_hidden: int = 192
    max_sequence_length: int = 512
    rope_theta: float = 10000.0
    init_std: float = 0.02
    # tower (SigLIP) and splicing
    tower_hidden: int = 24
    tower_layers: int = 1
    tower_heads: int = 2
    tower_mlp: int = 48
    patch_size: int = 96
    # optimizer
    lr: float = 1.5e-3
    warmup: int = 100
    end_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    b2: float = 0.98
    clip: float = 1.0
    eps: float = 1e-3
    block_mask_prob: float = 0.25
    # weight of the auxiliary probe loss (:func:`probe_loss`; 0: none)
    probe_weight: float = 0.5
    tasks: tuple[str, ...] = S.TASK_NAMES
    preset: str = "tiny_vision"

    def __post_init__(self):
        for name in ("steps", "batch", "gen_length", "block_length", "patch_size"):
            if getattr(self, name) <= 0:
                raise TrainError(f"{name} must be positive, got {getattr(self, name)}")
        if self.gen_length % self.block_length:
            raise TrainError(f"gen_length {self.gen_length} must be a multiple of block_length {self.block_length}")
        if self.gen_length < S.MAX_ANSWER_CHARS:
            raise TrainError(f"gen_length {self.gen_length} < the longest answer ({S.MAX_ANSWER_CHARS} tokens)")
        unknown = [t for t in self.tasks if t not in S.QUESTIONS]
        if unknown:
            raise TrainError(f"unknown image task(s) {', '.join(unknown)}")

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "tasks": list(self.tasks)}

    @classmethod
    def from_json(cls, d: dict) -> "VisionTrainConfig":
        return cls(**{**d, "tasks": tuple(d["tasks"])})


def model_config(tc: VisionTrainConfig, tok: Tokenizer) -> ModelConfig:
    """The LLaDA-V :class:`ModelConfig` of a run: the byte-level vocabulary, one ``1x1`` grid of 384 pixels."""
    side = S.SIZE
    vc = VisionConfig(hidden_size=tc.tower_hidden, n_layers=tc.tower_layers, n_heads=tc.tower_heads,
                      intermediate_size=tc.tower_mlp, image_size=side, patch_size=tc.patch_size,
                      grid_pinpoints=((side, side),), max_num_patches=4,
                      model_max_length=tc.max_sequence_length)
    v = tok.vocab_size
    cfg = ModelConfig(d_model=tc.d_model, n_heads=tc.n_heads, n_kv_heads=tc.n_heads, n_layers=tc.n_layers,
                      mlp_hidden_size=tc.mlp_hidden, vocab_size=v, embedding_size=v,
                      mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                      max_sequence_length=tc.max_sequence_length, rope_theta=tc.rope_theta, family="llada_v",
                      vision=vc)
    cfg.validate(tc.preset)
    return cfg


def init_params(tc: VisionTrainConfig, mcfg: ModelConfig) -> dict:
    """Initial parameters (numpy draws from ``seed``): LayerNorm/RMSNorm weights 1 and biases 0, the embedding
    N(0, 1), every other matrix and the newline row N(0, init_std)."""
    rng = np.random.default_rng([tc.seed, 0x1A1DA5])

    def make(path, shape):
        name = path[-1].key
        if name in ("attn_norm", "ff_norm", "ln_f") or name.endswith("ln_w") or name in ("ln1_w", "ln2_w"):
            return jnp.ones(shape, jnp.float32)
        if name.endswith("_b") or name in ("b1", "b2"):
            return jnp.zeros(shape, jnp.float32)
        std = 1.0 if name == "wte" else tc.init_std
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    return jax.tree_util.tree_map_with_path(make, param_shapes(mcfg), is_leaf=lambda x: isinstance(x, tuple))


#: Classes of the probe (:func:`probe_loss`): colour, shape, count.
PROBE_CLASSES = (len(S.COLOURS), len(S.SHAPES), len(S.COUNTS))


def init_state(tc: VisionTrainConfig, mcfg: ModelConfig) -> dict:
    """Params, the training-only probe (``w`` [D, 12] N(0, init_std), ``b`` zeros), optimizer state, step 0."""
    params = init_params(tc, mcfg)
    rng = np.random.default_rng([tc.seed, 0x9B0BE])
    n = sum(PROBE_CLASSES)
    probe = {"w": jnp.asarray(rng.standard_normal((mcfg.d_model, n), dtype=np.float32) * np.float32(tc.init_std)),
             "b": jnp.zeros((n,), jnp.float32)}
    opt_shapes = jax.eval_shape(TT.make_optimizer(tc).init, {"params": params, "probe": probe})
    return {"params": params, "probe": probe,
            "opt_state": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), opt_shapes), "step": jnp.int32(0)}


# ------------------------------------------------------------------------------------------------ data

def prompt(tok: Tokenizer, question: str) -> list[int]:
    """The user path's prompt ids of ``question`` about one image (with the ``IMAGE_TOKEN_INDEX`` placeholder)."""
    return io_images.image_prompt_ids(tok, question, 1)


def pixels(image, vc: VisionConfig) -> np.ndarray:
    """The official crops [n, 3, S, S] of a training picture (always 384 x 384 on the ``1x1`` grid)."""
    px = img.preprocess(image, vc)
    assert px.size == (S.SIZE, S.SIZE) and px.grid == (1, 1), (px.size, px.grid)
    return px.pixels


def make_batch(rng: np.random.Generator, tc: VisionTrainConfig, mcfg: ModelConfig, tok: Tokenizer,
               insts: Optional[Sequence[S.Instance]] = None) -> tuple[dict, list[S.Instance]]:
    """One training batch (numpy) of ``insts`` (default: ``tc.batch`` fresh ones from ``rng``).

    pixels [b, n, 3, S, S] float32; ids [b, L] int32 (row ``k``'s image rows named ``E + k*R + j``, the answer
    region the clean answer + EOS padding, pad = EOS); valid [b, L] bool; start [b] int32 (first answer token);
    labels [b, 3] int32 (the scene's colour, shape and count - 1, for :func:`probe_loss`).
    """
    insts = list(insts) if insts is not None else [S.sample(rng, tc.tasks) for _ in range(tc.batch)]
    b, G, E = len(insts), tc.gen_length, mcfg.embedding_size
    R = V.n_image_rows((S.SIZE, S.SIZE), mcfg.vision)
    prompts = []
    for k, inst in enumerate(insts):
        p = prompt(tok, inst.question)
        i = p.index(V.IMAGE_TOKEN_INDEX)
        prompts.append(p[:i] + list(range(E + k * R, E + (k + 1) * R)) + p[i + 1:])
    slot = prompt_slot(tc, mcfg, tok)
    ids = np.full((b, slot + G), tok.eos_token_id, np.int32)
    valid = np.zeros((b, slot + G), bool)
    start = np.zeros((b,), np.int32)
    for k, (p, inst) in enumerate(zip(prompts, insts)):
        n = len(p)
        ids[k, :n] = p
        ids[k, n:n + G] = TT.answer_ids(tok, inst.answer, G)
        valid[k, :n + G] = True
        start[k] = n
    px = np.stack([pixels(S.draw(inst.scene), mcfg.vision) for inst in insts])
    labels = np.array([(tuple(S.COLOURS).index(i.scene.colour), S.SHAPES.index(i.scene.shape), i.scene.count - 1)
                       for i in insts], np.int32)
    return {"pixels": px, "ids": ids, "valid": valid, "start": start, "labels": labels}, insts


def prompt_slot(tc: VisionTrainConfig, mcfg: ModelConfig, tok: Tokenizer) -> int:
    """The longest spliced prompt of the tasks, rounded up to 16 (the engine's slot)."""
    R = V.n_image_rows((S.SIZE, S.SIZE), mcfg.vision)
    longest = max(len(prompt(tok, S.QUESTIONS[t])) - 1 + R for t in tc.tasks)
    return -(-longest // 16) * 16


# ------------------------------------------------------------------------------------------------ model

def probe_loss(probe: dict, rows: jax.Array, labels: jax.Array) -> jax.Array:
    """The training-only auxiliary loss: a linear probe on the mean of each picture's image rows (RMS-normalised)
    predicts its colour, shape and count (the sum of the three cross-entropies, mean over the batch).

    Why: trained on the SFT loss alone, two runs learned the answers' priors and ignored the picture (the loss
    with the pictures shuffled between rows equal to 6 digits at steps 300 and 600): the tower's random
    features do not show colour or shape, the LM learns to do without them, and the gradient that would teach
    the tower passes through attention the LM no longer pays. The probe trains the tower and projector
    directly until the rows' mean (what attention that spreads over the picture reads) tells the scene; the
    probe itself is not part of the model. rows [b, R, D]; labels [b, 3]."""
    m = jnp.mean(rows.astype(jnp.float32), axis=1)  # [b, D]
    m = m * jax.lax.rsqrt(jnp.mean(jnp.square(m), axis=-1, keepdims=True) + 1e-6)
    logits = m @ probe["w"] + probe["b"]  # [b, 12]
    total, at = 0.0, 0
    for k, n in enumerate(PROBE_CLASSES):
        lp = jax.nn.log_softmax(logits[:, at:at + n], axis=-1)
        total = total - jnp.mean(jnp.take_along_axis(lp, labels[:, k:k + 1], axis=-1))
        at += n
    return total


def loss_fn(trainable: dict, batch: dict, key: jax.Array, mcfg: ModelConfig, tc: VisionTrainConfig):
    """LLaDA's SFT loss (:func:`bench.train_tiny.loss_fn`'s form) of the family's forward over the spliced rows,
    plus ``probe_weight`` times :func:`probe_loss`: the total (scalar) and (the row losses [b], the probe loss).
    ``trainable``: ``{"params": the model's, "probe": the probe's}``."""
    params = trainable["params"]
    px, ids, valid, start = batch["pixels"], batch["ids"], batch["valid"], batch["start"]
    b, n = px.shape[:2]
    b, L = ids.shape
    G, vc = tc.gen_length, mcfg.vision
    feats = vision.encode(params, px.reshape(b * n, *px.shape[2:]), vc)  # [b*n, T, D]
    feats = feats.reshape(b, n, *feats.shape[1:])
    rows = jax.vmap(lambda f: V.image_rows(f, (S.SIZE, S.SIZE), (1, 1), params["image_newline"], vc))(feats)
    table = rows.reshape(-1, rows.shape[-1])  # [b*R, D]: row k's image rows at k*R
    noise = TT.answer_mask(key, b, G, tc.eps, tc.block_length, tc.block_mask_prob)
    ans_idx = start[:, None] + jnp.arange(G, dtype=jnp.int32)[None]  # [b, G]
    answer = jnp.take_along_axis(ids, ans_idx, axis=1)
    noisy = ids.at[jnp.arange(b)[:, None], ans_idx].set(jnp.where(noise.masked, mcfg.mask_token_id, answer))
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (b, L))
    h = V.forward({**params, "image_rows": table}, noisy, mcfg, pos, pos, valid).h  # [b, L, D]
    logits = V.lm_head(params, jnp.take_along_axis(h, ans_idx[..., None], axis=1), mcfg)  # [b, G, V]
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), answer[..., None], axis=-1)[..., 0]
    total = jnp.sum(jnp.where(noise.masked, ce, 0.0), axis=1)
    n_masked = jnp.maximum(jnp.sum(noise.masked, axis=1), 1)
    row = jnp.where(noise.structured, total / n_masked, total / noise.t / G)  # [b]
    aux = probe_loss(trainable["probe"], rows, batch["labels"]) if tc.probe_weight else jnp.float32(0.0)
    return jnp.mean(row) + tc.probe_weight * aux, (row, aux)


def make_train_step(tc: VisionTrainConfig, mcfg: ModelConfig):
    """The jitted ``step(state, batch) -> (state, loss, row_loss, grad_norm, probe_loss)``."""
    tx = TT.make_optimizer(tc)
    base_key = jax.random.PRNGKey(tc.seed)

    def step(state, batch):
        key = jax.random.fold_in(jax.random.fold_in(base_key, 1), state["step"])
        trainable = {"params": state["params"], "probe": state["probe"]}
        (loss, (row, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, batch, key, mcfg, tc)
        updates, opt_state = tx.update(grads, state["opt_state"], trainable)
        new = optax.apply_updates(trainable, updates)
        return ({**new, "opt_state": opt_state, "step": state["step"] + 1}, loss, row, optax.tree.norm(grads), aux)

    return jax.jit(step, donate_argnums=(0,))


# ------------------------------------------------------------------------------------------------ eval

def evaluate(params, mcfg: ModelConfig, tok: Tokenizer, tc: VisionTrainConfig, n_per_task: int,
             engine=None, dcfg: Optional[DecodeConfig] = None, return_outputs: bool = False):
    """Exact match per task on held-out instances ``0..n-1`` (:func:`bench.tasks.shapes.eval_instances`), each
    picture through the engine's own image path (:func:`polestar_jax.engine.images.prompt_with_images`),
    decoded by ``dcfg`` (default the one-token-per-step sampler, ``llada``, steps = gen length)."""
    from polestar_jax.engine.engine import Engine
    from polestar_jax.engine.images import prompt_with_images

    engine = engine or Engine(params, mcfg, tok)
    dcfg = dcfg or DecodeConfig(decoder="llada", cache="none", gen_length=tc.gen_length,
                                block_length=tc.block_length, steps=tc.gen_length, threshold=None)
    items = [inst for task in tc.tasks for inst in S.eval_instances(task, n_per_task)]
    prompts, rows = [], []
    for inst in items:
        p, r = prompt_with_images(params, mcfg, prompt(tok, inst.question), [S.draw(inst.scene)])
        prompts.append(p)
        rows.append(r)
    res = engine.run(prompts, dcfg, seed=0, prompt_slot=prompt_slot(tc, mcfg, tok), params=params, images=rows)
    outputs = [decode_answer(tok, res.row(r).tokens) for r in range(len(items))]
    hits: dict[str, list[bool]] = defaultdict(list)
    for inst, out in zip(items, outputs):
        hits[inst.task].append(S.score(inst, out))
    acc = {t: float(np.mean(hits[t])) for t in tc.tasks}
    return (acc, list(zip(items, outputs))) if return_outputs else acc


# ------------------------------------------------------------------------------------------------ train

def train(tc: VisionTrainConfig, out: str, resume: bool = False, max_minutes: Optional[float] = None,
          save_every: int = 100, eval_every: int = 250, eval_n: int = 16, log_every: int = 25,
          command: str = "") -> dict:
    """Trains up to ``tc.steps`` (or ``max_minutes`` of this piece); saves every ``save_every`` steps and at
    the end. Returns ``{"state", "meta", "mcfg", "tok"}``."""
    tok = load_tokenizer(asset_model_dir(TOKENIZER_SOURCE))
    mcfg = model_config(tc, tok)
    mngr = TT._ckpt_manager(out)
    if mngr.latest_step() is not None:
        if not resume:
            raise TrainError(f"{out} already holds a checkpoint (step {mngr.latest_step()}); pass --resume")
        state, meta = TT.restore(mngr, init_state(tc, mcfg))
        state = jax.tree.map(jnp.asarray, jax.device_get(state))
        saved = VisionTrainConfig.from_json(meta["train_config"])
        if dataclasses.replace(saved, steps=tc.steps) != tc:
            raise TrainError("--resume: the configuration differs from the checkpoint's")
        rng = TT._rng_from_json(meta["rng_state"])
        meta["train_config"] = tc.to_json()
    else:
        state, rng = init_state(tc, mcfg), S.train_rng(tc.seed)
        meta = {"train_config": tc.to_json(), "train_seconds": 0.0, "history": [], "evals": [], "commands": []}
    meta["commands"].append(command)
    step_fn = make_train_step(tc, mcfg)
    step = int(state["step"])
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    TT._log(f"tiny_vision: LM {tc.n_layers}L d{tc.d_model}, tower {tc.tower_layers}L c{tc.tower_hidden} patch "
            f"{tc.patch_size}, {n_params:,} params; batch {tc.batch}, rows {prompt_slot(tc, mcfg, tok)}+"
            f"{tc.gen_length}; steps {step} -> {tc.steps}")
    t_run = time.perf_counter()
    secs0, t_last, n_last = meta["train_seconds"], t_run, step
    pending: list = []
    engine = None

    def checkpoint():
        if mngr.latest_step() == step:
            return
        meta["train_seconds"] = secs0 + time.perf_counter() - t_run
        meta["rng_state"] = TT._rng_state_to_json(rng)
        TT.save(mngr, state, meta)

    while step < tc.steps:
        batch, insts = make_batch(rng, tc, mcfg, tok)
        state, loss, row, gnorm, aux = step_fn(state, batch)
        pending.append((loss, row, gnorm, aux, [i.task for i in insts]))
        step += 1
        out_of_time = max_minutes is not None and time.perf_counter() - t_run > 60 * max_minutes
        if step % log_every == 0 or step == tc.steps or out_of_time:
            vals = jax.device_get([p[:4] for p in pending])
            by_task: dict[str, list[float]] = defaultdict(list)
            for (_, r, _, _), names in zip(vals, (p[4] for p in pending)):
                for name, x in zip(names, r):
                    by_task[name].append(float(x))
            now = time.perf_counter()
            rec = {"step": step, "loss": float(np.mean([v[0] for v in vals])),
                   "grad_norm": float(np.mean([v[2] for v in vals])),
                   "probe_loss": round(float(np.mean([v[3] for v in vals])), 4),
                   "task_loss": {k: round(float(np.mean(v)), 4) for k, v in sorted(by_task.items())},
                   "s_per_step": round((now - t_last) / max(1, step - n_last), 3),
                   "minutes": round((secs0 + now - t_run) / 60, 2)}
            pending, t_last, n_last = [], now, step
            meta["history"].append(rec)
            TT._log(f"step {step:5d} loss {rec['loss']:.4f} probe {rec['probe_loss']:.3f} gnorm {rec['grad_norm']:.2f} {rec['s_per_step']:.2f}s/step "
                    f"{rec['minutes']:.1f}min | " + " ".join(f"{k}={v:.3f}" for k, v in rec["task_loss"].items()))
        if step % save_every == 0 or step == tc.steps or out_of_time:
            checkpoint()
        if eval_every and eval_n and (step % eval_every == 0 or step == tc.steps):
            from polestar_jax.engine.engine import Engine

            t0 = time.perf_counter()
            engine = engine or Engine(state["params"], mcfg, tok)
            acc = evaluate(state["params"], mcfg, tok, tc, eval_n, engine=engine)
            meta["evals"].append({"step": step, "n_per_task": eval_n, "acc": acc})
            TT._log(f"eval step {step} ({eval_n}/task, {time.perf_counter() - t0:.0f}s): "
                    + " ".join(f"{k}={v:.2f}" for k, v in acc.items()))
        if out_of_time:
            TT._log(f"stopping after {max_minutes} minutes at step {step}")
            break
    checkpoint()
    mngr.close()
    return {"state": state, "meta": meta, "mcfg": mcfg, "tok": tok}


def load_checkpoint(out: str) -> tuple[dict, VisionTrainConfig]:
    """The latest checkpoint of ``out`` (only read) and its configuration."""
    import orbax.checkpoint as ocp

    mngr = TT._ckpt_manager(out)
    step = mngr.latest_step()
    if step is None:
        raise TrainError(f"{out} holds no checkpoint")
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    tc = VisionTrainConfig.from_json(meta["train_config"])
    tok = load_tokenizer(asset_model_dir(TOKENIZER_SOURCE))
    mcfg = model_config(tc, tok)
    state, meta = TT.restore(mngr, jax.eval_shape(lambda: init_state(tc, mcfg)), step)
    mngr.close()
    return {"state": state, "meta": meta, "mcfg": mcfg, "tok": tok}, tc


# ------------------------------------------------------------------------------------------------ export

def export(result: dict, tc: VisionTrainConfig, out_dir: str, eval_n: int = 100) -> dict:
    """Writes the HF LLaDA-V folder ``out_dir`` (float32), checks it loads back to the same weights, evaluates
    the loaded model on ``eval_n`` held-out pictures per task and writes its README."""
    from polestar_jax.io.checkpoint import copy_aux_files, export_hf, load_model

    mcfg, tok, meta = result["mcfg"], result["tok"], result["meta"]
    params = jax.device_get(result["state"]["params"])
    os.makedirs(out_dir, exist_ok=True)
    export_hf(out_dir, mcfg, params, extra_config={"bos_token_id": tok.bos_token_id})
    copy_aux_files(asset_model_dir(TOKENIZER_SOURCE), out_dir,
                   names=("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                          "generation_config.json"))
    for name, update in (("generation_config.json", dict(gen_length=tc.gen_length, block_length=tc.block_length,
                                                        steps=tc.gen_length)),
                         ("tokenizer_config.json", dict(model_max_length=mcfg.max_sequence_length))):
        path = os.path.join(out_dir, name)
        with open(path) as f:
            d = json.load(f)
        d.update(update)
        with open(path, "w") as f:
            json.dump(d, f, indent=2, sort_keys=True, ensure_ascii=False)
            f.write("\n")
    cfg2, params2 = load_model(out_dir)
    assert cfg2 == mcfg, (cfg2, mcfg)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    t0 = time.perf_counter()
    acc = evaluate(params2, cfg2, load_tokenizer(out_dir), tc, eval_n)
    eval_s = time.perf_counter() - t0
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(_readme(tc, mcfg, meta, acc, eval_n, eval_s, int(result["state"]["step"]),
                        sum(int(x.size) for x in jax.tree.leaves(params))))
    return acc


def _readme(tc, mcfg, meta, acc, eval_n, eval_s, step, n_params) -> str:
    cmds = "\n".join(c for c in meta.get("commands", []) if c)
    rows = "\n".join(f"| {k} | {S.QUESTIONS[k]} | {acc[k] * 100:.1f}% |" for k in acc)
    last = meta["history"][-1] if meta.get("history") else {}
    R = V.n_image_rows((S.SIZE, S.SIZE), mcfg.vision)
    return f"""# tiny_vision: a tiny LLaDA-V trained on synthetic pictures

A LLaDA-V-architecture model (`LlavaLLaDAModelLM`: a {tc.tower_layers + 1}-layer SigLIP config of which the
loader runs {tc.tower_layers} (width {tc.tower_hidden}, {tc.tower_heads} heads, MLP {tc.tower_mlp}, patch
{tc.patch_size} on LLaDA-V's 384-pixel crops), the `mlp2x_gelu` projector, `anyres_max_4` with the single grid
`1x1`, and a {tc.n_layers}-layer LLaDA LM of width {tc.d_model} ({tc.n_heads} heads, MLP {tc.mlp_hidden});
{n_params:,} float32 parameters) with the byte-level tokenizer and LLaDA chat template of `tiny_random`,
trained from scratch on CPU by `bench/train_vision.py` with LLaDA's SFT objective on the picture questions of
`bench/tasks/shapes.py` (issue #46 item 5), plus {tc.probe_weight:g} times a training-only probe loss (a linear probe on the
mean of each picture's image rows predicts its colour, shape and count: `bench.train_vision.probe_loss`; the
probe is not part of the folder). It is the LLaDA-V test bed for the user path (CLI, API, server)
and for decoder accuracy versus speed.

* Pictures: 1-4 circles, squares or triangles of one colour (red, green, blue, yellow, purple) on a light
  background, 384 x 384 pixels, each object inside one 64-pixel cell (`bench.tasks.shapes.draw`). A 384 x 384
  picture becomes 2 crops and {R} image rows; other sizes are letterboxed onto the one grid (never trained).
* Questions (the user path's prompt: LLaDA-V's system message, `<image>` before the question, the chat
  template) and answers: {'; '.join(f'"{q}"' for q in S.QUESTIONS.values())}; answers like `red`,
  `circle`, `three`, `three red circles`.
* Generation length **{tc.gen_length}** (answers padded with `<|endoftext|>`), block length {tc.block_length}
  (the defaults in `generation_config.json`).
* Training: {step} steps of batch {tc.batch}, AdamW (peak lr {tc.lr}, warmup {tc.warmup}, cosine to
  {tc.lr * tc.end_lr_ratio:g}, weight decay {tc.weight_decay}, clip {tc.clip}), seed {tc.seed}, the four tasks
  uniformly, {tc.block_mask_prob:g} of the rows with block-structured masks; tower, projector, newline row and LM
  trained together through the family's own forward; {meta.get('train_seconds', 0) / 60:.0f} minutes on a
  shared {os.cpu_count()}-core CPU; final training loss {last.get('loss', float('nan')):.4f}.

Command(s):

```
{cmds}
```

## Accuracy

Exact match on {eval_n} held-out pictures per task (scene seeds >= 1,000,000,000, never trained on) with the
one-token-per-step sampler (`decoder=llada`, steps = gen length = {tc.gen_length}, block {tc.block_length}),
evaluated on the exported folder ({eval_s:.0f} s):

| task | question | exact match |
|---|---|---|
{rows}
"""


# ------------------------------------------------------------------------------------------------ CLI

def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (module docstring): 0 when done, 2 with one ``error:`` line for bad input."""
    return cli.report_errors(_main, argv)


def _main(argv: Optional[Sequence[str]]) -> None:
    ap = cli.Parser(prog="python -m bench.train_vision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint folder (orbax CheckpointManager)")
    ap.add_argument("--steps", type=int, default=None, help=f"total steps (default {VisionTrainConfig.steps})")
    ap.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (and save) after this many minutes")
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-n", type=int, default=16, help="held-out pictures per task for periodic evals")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--export", default=None, help="write an HF model folder here (after training)")
    ap.add_argument("--export-eval-n", type=int, default=100)
    ap.add_argument("--export-only", action="store_true", help="export the latest checkpoint of --out")
    args = ap.parse_args(argv)
    if args.export_only:
        if not args.export:
            raise TrainError("--export-only needs --export DIR")
        res, tc = load_checkpoint(args.out)
        acc = export(res, tc, args.export, args.export_eval_n)
        TT._log(f"exported step {int(res['state']['step'])} to {args.export}: "
                + " ".join(f"{k}={v:.3f}" for k, v in acc.items()))
        return
    fields = {k: v for k, v in dict(steps=args.steps, seed=args.seed, batch=args.batch, lr=args.lr).items()
              if v is not None}
    base = VisionTrainConfig()
    if args.resume and os.path.isdir(args.out):
        try:
            res, saved = load_checkpoint(args.out)
            base = saved
        except TrainError:
            pass
    tc = dataclasses.replace(base, **fields)
    command = "python -m bench.train_vision " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    res = train(tc, args.out, resume=args.resume, max_minutes=args.max_minutes, save_every=args.save_every,
                eval_every=args.eval_every, eval_n=args.eval_n, log_every=args.log_every, command=command)
    if args.export:
        acc = export(res, tc, args.export, args.export_eval_n)
        TT._log(f"exported to {args.export}: " + " ".join(f"{k}={v:.3f}" for k, v in acc.items()))


if __name__ == "__main__":
    sys.exit(main())
