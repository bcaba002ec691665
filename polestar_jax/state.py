"""The decode state: one pytree holding everything a decode needs between compiled calls.

Static shapes are fixed by (batch b, total length L = padded prompt P + gen length G, layers N, heads).
Prompts are left-padded to P; padded positions are hidden from attention by ``key_valid`` and the RoPE
positions of each row start at 0 on its first real token, so a padded row computes what it would alone.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from polestar_jax.config import ModelConfig


@flax.struct.dataclass
class DecodeState:
    """Decode state (all arrays; a pytree).

    x            [b, L] int32   tokens; ``mask_token_id`` marks undecided positions, pad id the left padding.
    commit_step  [b, L] int32   index of the forward (of that row) that committed each position; -1 if not.
    nfe          [b]    int32   forwards (network function evaluations) of each row so far.
    pos          [b, L] int32   RoPE position of each slot (index minus the row's padding).
    key_valid    [b, L] bool    False on left padding.
    rng          [b, 2] uint32  one PRNG key per row (sampling noise; folded with the row's forward count).
    block_nfe    [b, n_blocks] int32  forwards spent on each block.
    k_cache, v_cache  [N, b, KV, L, hd] or None: un-rotated K/V of the last full pass / step.
    polestar     Polestar's clusters, hidden states and drift state (decoder "polestar"), else None.
    """

    x: jax.Array
    commit_step: jax.Array
    nfe: jax.Array
    pos: jax.Array
    key_valid: jax.Array
    rng: jax.Array
    block_nfe: jax.Array
    k_cache: Optional[jax.Array] = None
    v_cache: Optional[jax.Array] = None
    polestar: Optional[Any] = None  # polestar_jax.polestar.PolestarCache for decoder "polestar"


def seed_key_data(seed: int) -> np.ndarray:
    """The key data of ``jax.random.PRNGKey(seed)`` (threefry: [high 32 bits, low 32 bits]) computed in
    numpy, so states can be built under tracing (``jax.eval_shape``) too."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return np.asarray([(s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF], np.uint32)


def padded_length(lengths: Sequence[int], multiple: int) -> int:
    """Prompt slot length: the longest prompt rounded up to ``multiple`` (bucketing avoids recompiles)."""
    longest = max(lengths)
    return -(-longest // multiple) * multiple


def init_state(
    prompts: Sequence[Sequence[int]],
    cfg: ModelConfig,
    gen_length: int,
    prompt_slot: int,
    num_blocks: int,
    seeds: Sequence[int],
    cache: bool,
    dtype=jnp.float32,
) -> DecodeState:
    """Builds the initial state: prompts left-padded into ``prompt_slot`` slots, ``gen_length`` masks after."""
    b = len(prompts)
    length = prompt_slot + gen_length
    x = np.full((b, length), cfg.mask_token_id, np.int32)
    pad = np.zeros((b,), np.int32)
    for r, p in enumerate(prompts):
        pad[r] = prompt_slot - len(p)
        x[r, : pad[r]] = cfg.pad_token_id
        x[r, pad[r]: prompt_slot] = np.asarray(p, np.int32)
    idx = np.arange(length, dtype=np.int32)[None, :]
    pos = idx - pad[:, None]
    key_valid = idx >= pad[:, None]
    rng = np.stack([seed_key_data(s) for s in seeds])
    k_cache = v_cache = None
    if cache:
        shape = (cfg.n_layers, b, cfg.n_kv_heads, length, cfg.head_dim)
        k_cache = jnp.zeros(shape, dtype)
        v_cache = jnp.zeros(shape, dtype)
    return DecodeState(
        x=jnp.asarray(x), commit_step=jnp.full((b, length), -1, jnp.int32), nfe=jnp.zeros((b,), jnp.int32),
        pos=jnp.asarray(pos), key_valid=jnp.asarray(key_valid), rng=jnp.asarray(rng),
        block_nfe=jnp.zeros((b, num_blocks), jnp.int32),
        k_cache=k_cache, v_cache=v_cache,
    )
