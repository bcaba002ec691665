"""A fake model family: no weights, one-hot logits that spell a fixed script (the engine and scheduler tests,
and ``bench/scheduler_overlap.py``).

Token at RoPE position p (counted from the row's first real token) is ``2 + p % 5`` before position ``EOS_AT``
and EOS from there on, with confidence ~0.9993 everywhere. So every forward's commits, every block's tokens
and every response are known in advance (:func:`expected`), in milliseconds of compute. :func:`registered`
with ``device_iters`` adds device work of a fixed size to every forward (chained matmuls, asynchronous like
any compiled program: a host callback would make the program run synchronously), so the device time of a
block can be set too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from polestar_jax.config import ModelConfig
from polestar_jax.models import family
from polestar_jax.models.llada import ForwardOut

V, EOS, MASK, PAD, EOS_AT, B = 16, 1, 15, 0, 14, 4
CFG = ModelConfig(d_model=V, n_heads=1, n_kv_heads=1, n_layers=1, mlp_hidden_size=4, vocab_size=V,
                  embedding_size=V, mask_token_id=MASK, eos_token_id=EOS, pad_token_id=PAD,
                  max_sequence_length=64, family="fake")
PARAMS = {"w": jnp.zeros((1,), jnp.float32)}


def script(pos):
    return jnp.where(pos >= EOS_AT, EOS, 2 + pos % 5)


def busy(x: jax.Array, iters: int) -> jax.Array:
    """``iters`` chained 256x256 matmuls on a buffer derived from ``x``, folded to a scalar: device work of a
    known size (XLA cannot drop it: its result reaches the output)."""
    m = jnp.full((256, 256), 1e-3, jnp.float32) + jnp.sum(x).astype(jnp.float32) * 1e-9
    m = lax.fori_loop(0, iters, lambda i, a: jnp.tanh(a @ a), m)
    return jnp.sum(m) * 0.0


def _forward(params, ids, cfg, q_pos, key_pos, key_valid=None, cache=None, start=0, write=None, unroll=1,
             device_iters: int = 0, into=None, **_):
    if device_iters:  # the forward's device time: matmuls whose result reaches the logits (times zero)
        q_pos = q_pos + busy(q_pos, device_iters).astype(q_pos.dtype)
    h = 10.0 * jax.nn.one_hot(script(q_pos), V)
    if cache is None and into is not None:  # a full pass into the state's buffers: kept as they are (no K/V
        cache = into  # is ever read; a running batch's rows share them: llada.CacheSlot)
    if cache is None:
        b, length = key_pos.shape
        z = jnp.zeros(family.LLADA.cache_shape(cfg, b, length), jnp.float32)
        cache = (z, z)
    return ForwardOut(h, cache, None)


FAKE = dataclasses.replace(family.LLADA, name="fake", forward=_forward, embed=lambda p, ids: ids,
                           lm_head=lambda params, h, cfg: h.astype(jnp.float32))


@contextlib.contextmanager
def registered(device_iters: int = 0):
    """The fake family registered for the block (and removed after); ``device_iters``: each forward also runs
    :func:`busy` with this many matmuls (device time of a known size)."""
    fam = FAKE if not device_iters else dataclasses.replace(
        FAKE, forward=functools.partial(_forward, device_iters=device_iters))
    family.register_family(fam)
    try:
        yield fam
    finally:
        family.FAMILIES.unregister("fake")


def expected(prompt_len: int, gen: int = 16) -> np.ndarray:
    """The tokens the fake model decodes after a prompt of ``prompt_len`` tokens (any decoder)."""
    p = prompt_len + np.arange(gen)
    return np.where(p >= EOS_AT, EOS, 2 + p % 5)


class LetterTokenizer:
    """A tokenizer for the fake vocabulary: id i is the letter ``"abcdefghijklmnop"[i]``; ``host_seconds``: the
    time each :meth:`decode` takes (the host's work per row and block, known)."""

    LETTERS = "abcdefghijklmnop"

    def __init__(self, host_seconds: float = 0.0):
        self.host_seconds = host_seconds

    def decode(self, ids) -> str:
        if self.host_seconds:
            time.sleep(self.host_seconds)
        return "".join(self.LETTERS[int(i)] for i in ids)

    def encode(self, text: str) -> list[int]:
        return [self.LETTERS.index(c) for c in text]


def response_text(prompt_len: int) -> str:
    """The whole response to a prompt of ``prompt_len`` tokens (cut at the first EOS)."""
    return LetterTokenizer().decode(expected(prompt_len)[: EOS_AT - prompt_len])
