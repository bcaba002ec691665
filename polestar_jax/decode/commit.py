"""Commit rules: which masked positions of the current block take their predicted token this step.

All rules share one scoring step (:func:`predict`): ``x0`` = argmax of the (optionally Gumbel-perturbed)
logits, never the mask token, and ``conf`` = softmax probability of ``x0`` (or a uniform draw for
``remasking="random"``), -inf on positions that are not candidates. Candidates are ranked by confidence,
ties towards the lowest index (:func:`rank_desc`). Then:

* ``fixed``: the ``k`` most confident candidates (LLaDA's ``get_num_transfer_tokens`` schedule).
* ``threshold``: the most confident candidate always, every other one iff ``conf >= threshold``
  (Fast-dLLM ``get_transfer_index``).
* ``factor``: Fast-dLLM's ``get_transfer_index_dynamic``: with candidates sorted by confidence, the
  ``j``-th (0-based) passes iff ``conf_j >= 1 - factor / (j + 2)``; the count committed is the index of the
  first failure (at least 1), and all ``n`` when the first failure is the last candidate (as the reference).

Dream's fixed rule (``DecodeConfig.schedule="timesteps"``, ``rank_by="neg_entropy"``): :func:`timestep_schedule`
and :func:`neg_entropy`.

Shapes: ``logits`` [b, T, V] float32, ``masked`` [b, T] bool; outputs [b, T].
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np


class Prediction(NamedTuple):
    x0: jax.Array  # [b, T] int32 predicted token (never the mask id)
    conf: jax.Array  # [b, T] float32 confidence on candidates, -inf elsewhere


def predict(
    logits: jax.Array,
    masked: jax.Array,
    mask_id: int,
    temperature: jax.Array | float = 0.0,
    noise_keys: Optional[jax.Array] = None,
    random_remask: bool = False,
    noise: Optional[jax.Array] = None,
) -> Prediction:
    """Predicted tokens and confidences for one forward's block rows.

    ``temperature`` > 0 perturbs the logits with Gumbel noise as LLaDA does
    (``argmax exp(l) / (-log u)^T`` = ``argmax l + T * g``, g ~ Gumbel(0, 1)); ``noise_keys`` [b, 2] (one
    key per row) is then required, or the noise itself, ``noise`` [b, T, V] (:func:`gumbel_noise`). The
    confidence is the probability of ``x0`` under the un-perturbed softmax. With ``random_remask`` the
    confidence is a uniform draw instead (LLaDA ``remasking="random"``).
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    not_mask = jnp.arange(vocab) != mask_id
    scored = logits
    if noise is None and noise_keys is not None:
        noise = gumbel_noise(noise_keys, logits.shape[1:])
    if noise is not None:
        scored = logits + jnp.asarray(temperature, jnp.float32) * noise
    # (one pass over the logits on an accelerator, two on the CPU: docs/kernels.md#on-a-gpu)
    x0, prob = jax.lax.platform_dependent(scored, not_mask, logits, cpu=top1_two_pass, default=top1_one_pass)
    conf = prob
    if random_remask:
        conf = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), masked.shape[1:]))(noise_keys)
    conf = jnp.where(masked, conf, -jnp.inf)
    return Prediction(x0, conf)


def top1_two_pass(scored: jax.Array, not_mask: jax.Array, logits: Optional[jax.Array] = None
                  ) -> tuple[jax.Array, jax.Array]:
    """``x0`` [b, T] = argmax of ``scored`` [b, T, V] over the tokens ``not_mask`` [V] allows (ties: the lowest
    id) and its probability under the softmax of ``logits`` (default: ``scored``): a max, then a sum of
    exponentials, then the token's logit (two passes over the logits; the numerics every golden replay
    was made with)."""
    logits = scored if logits is None else logits
    # docs/differences.md#d1: the mask token is never a prediction, so every commit makes progress.
    x0 = jnp.argmax(jnp.where(not_mask, scored, -jnp.inf), axis=-1).astype(jnp.int32)
    m = jnp.max(logits, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1))
    lx = jnp.take_along_axis(logits, x0[..., None], axis=-1)[..., 0]
    return x0, jnp.exp(lx - m[..., 0] - lse)


def top1_one_pass(scored: jax.Array, not_mask: jax.Array, logits: Optional[jax.Array] = None
                  ) -> tuple[jax.Array, jax.Array]:
    """:func:`top1_two_pass` in one pass over the vocabulary: a single variadic reduction carries the allowed
    maximum of ``scored`` [b, T, V] and its id and logit, the overall maximum of ``logits`` (default:
    ``scored``) and the sum of exponentials rescaled to it (an online softmax), so a GPU or TPU reads the
    [b, T, V] logits once where the two-pass form reads them twice (the LM head's float32 output is the
    largest activation of a step: 0.5 GB at batch 32 with LLaDA-8B's vocabulary). Equal to
    :func:`top1_two_pass` up to float rounding of the probability (the same ``x0``, ties included)."""
    logits = scored if logits is None else logits
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    allowed = jnp.where(not_mask, scored, -jnp.inf)

    def combine(a, b):
        (va, ia, la, ma, sa), (vb, ib, lb, mb, sb) = a, b
        take_b = (vb > va) | ((vb == va) & (ib < ia))
        m = jnp.maximum(ma, mb)
        scale = lambda mx, s: jnp.where(mx == -np.inf, 0.0, s * jnp.exp(mx - m))  # (no closed-over arrays)
        return (jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia), jnp.where(take_b, lb, la), m,
                scale(ma, sa) + scale(mb, sb))

    ninf = np.float32(-np.inf)
    init = (ninf, np.int32(logits.shape[-1]), ninf, ninf, np.float32(0))
    _, x0, lx, m, s = jax.lax.reduce((allowed, ids, logits, logits, jnp.ones_like(logits)), init, combine,
                                     (logits.ndim - 1,))
    return x0, jnp.exp(lx - m) / s


def gumbel_noise(keys: jax.Array, shape: tuple) -> jax.Array:
    """Gumbel(0, 1) noise [b, *shape] float32, one key per row (``keys`` [b, 2]: :func:`noise_keys`)."""
    return jax.vmap(lambda k: jax.random.gumbel(k, shape, jnp.float32))(keys)


def noise_keys(rng: jax.Array, counter: jax.Array, salt: int = 0) -> jax.Array:
    """Per-row key data [b, 2] for one forward's sampling noise: the row key ``rng`` [b, 2] folded with the
    row's forward count ``counter`` [b] (and ``salt`` > 0 for a second draw in the same forward)."""
    def one(k, n):
        key = jax.random.fold_in(jax.random.wrap_key_data(k), n)
        if salt:
            key = jax.random.fold_in(key, salt)
        return jax.random.key_data(key)

    return jax.vmap(one)(rng, counter)


def rank_desc(conf: jax.Array, tie_order: Optional[np.ndarray] = None) -> jax.Array:
    """Rank of each position by descending ``conf`` [b, T] (0 = most confident; ties: lower index first,
    or earlier in ``tie_order``, a static permutation of the T positions, when given)."""
    if tie_order is not None:
        perm = np.asarray(tie_order)
        return rank_desc(conf[:, perm])[:, np.argsort(perm)]
    order = jnp.argsort(-conf, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True).astype(jnp.int32)


def _candidates_only(conf: jax.Array, masked: jax.Array) -> jax.Array:
    return jnp.where(masked, conf, -jnp.inf)


def commit_fixed(conf: jax.Array, masked: jax.Array, k: jax.Array) -> jax.Array:
    """The ``k`` [b] most confident candidates."""
    return masked & (rank_desc(_candidates_only(conf, masked)) < k[:, None])


def commit_threshold(conf: jax.Array, masked: jax.Array, threshold: jax.Array | float,
                     tie_order: Optional[np.ndarray] = None) -> jax.Array:
    """The most confident candidate, and every candidate with ``conf >= threshold`` (``tie_order``: see
    :func:`rank_desc`)."""
    return masked & ((rank_desc(_candidates_only(conf, masked), tie_order) == 0) | (conf >= threshold))


def commit_factor(conf: jax.Array, masked: jax.Array, factor: jax.Array | float) -> jax.Array:
    """Fast-dLLM's dynamic ("factor") rule, reproduced including its last-candidate quirk."""
    n = jnp.sum(masked, axis=-1)  # [b]
    conf = _candidates_only(conf, masked)
    srt = -jnp.sort(-conf, axis=-1)  # descending; candidates first, -inf after
    j = jnp.arange(conf.shape[-1])
    thr = jnp.where(j == 0, -1.0, 1.0 - factor / (j + 2.0))
    fail = (srt < thr) & (j < n[:, None])
    first_fail = jnp.min(jnp.where(fail, j, conf.shape[-1]), axis=-1)  # [b]
    count = jnp.where(first_fail >= n - 1, n, first_fail)
    return masked & (rank_desc(conf) < count[:, None])


def fixed_schedule(n_masked: jax.Array, steps: int, i: jax.Array) -> jax.Array:
    """LLaDA's ``get_num_transfer_tokens``: tokens to commit at step ``i`` when ``n_masked`` [b] masked
    tokens are spread over ``steps`` steps (the first ``n % steps`` steps take one more); 0 for i >= steps."""
    base = n_masked // steps
    rem = n_masked % steps
    k = base + (i < rem).astype(n_masked.dtype)
    return jnp.where(i < steps, k, 0)


def neg_entropy(logits: jax.Array) -> jax.Array:
    """Dream's ``alg="entropy"`` score of each position: ``sum p log(p + 1e-10)`` of the softmax of
    ``logits`` [b, T, V] (float32), [b, T]; higher is more certain."""
    p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.sum(p * jnp.log(p + 1e-10), axis=-1)


def timesteps(steps: int, eps: float) -> np.ndarray:
    """``torch.linspace(1, eps, steps + 1)`` in float32 as torch computes it (``start + step * i`` for the
    first half, ``end - step * (steps - i)`` for the second)."""
    n = steps + 1
    start, end = np.float32(1.0), np.float32(eps)
    step = np.float32((end - start) / np.float32(max(n - 1, 1)))
    i = np.arange(n)
    return np.where(i < n // 2, start + step * i.astype(np.float32),
                    end - step * (n - 1 - i).astype(np.float32)).astype(np.float32)


def timestep_schedule(n_masked: jax.Array, steps: int, i: jax.Array, eps: float) -> jax.Array:
    """Dream's fixed schedule: tokens to commit at step ``i`` of a block of ``steps`` steps when
    ``n_masked`` [b] masks are left: ``int(n * (1 - s / t))`` with ``t, s`` = timesteps ``i, i + 1`` of
    :func:`timesteps` (float32 as the reference), and all ``n`` from step ``steps - 1`` on (the reference
    stops at step ``steps`` even with masks left; here the block always fills: ``docs/differences.md#d28``)."""
    ts = jnp.asarray(timesteps(steps, eps))
    j = jnp.clip(i, 0, steps - 1)
    ratio = jnp.float32(1.0) - ts[j + 1] / ts[j]
    k = jnp.floor(n_masked.astype(jnp.float32) * ratio).astype(n_masked.dtype)
    return jnp.where(i >= steps - 1, n_masked, k)
