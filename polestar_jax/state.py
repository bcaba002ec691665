"""The decode state: one pytree holding everything a decode needs between compiled calls.

Static shapes are fixed by (batch b, total length L = padded prompt P + gen length G, layers N, heads).
Prompts are left-padded to P; padded positions are hidden from attention by ``key_valid`` and the RoPE
positions of each row start at 0 on its first real token, so a padded row computes what it would alone.

Every array field declares its axes once (:func:`axes`): which dimension is the batch (mesh axis
``"data"``) and which may be split over the ``"model"`` axis. Row selection (:func:`select_rows`: a finished
row waits unchanged) and sharding (:mod:`polestar_jax.sharding`) read those declarations; nothing else
knows where a field's batch axis is.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from polestar_jax.config import DecodeConfig, ModelConfig
from polestar_jax.errors import PolestarError

#: Axes of a batch-leading field: [b, ...].
BATCH = ("data",)
#: Axes of a layer-major field: [N, b, ...].
LAYER_BATCH = (None, "data")


def axes(spec: tuple = BATCH, select: bool = True, **kwargs):
    """A state field whose dimensions map to the mesh axes ``spec`` (``"data"`` marks the batch axis,
    ``"model"`` a dimension that may be split over the model axis, None a replicated one). ``select=False``:
    :func:`select_rows` takes the new value as is (fields a step only writes for active rows)."""
    return flax.struct.field(metadata={"axes": tuple(spec), "select": select}, **kwargs)


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
    polestar     Polestar's clusters, hidden states and drift state
                 (:class:`polestar_jax.polestar_state.PolestarState`, decoder "polestar"), else None.
    """

    x: jax.Array = axes()
    commit_step: jax.Array = axes()
    nfe: jax.Array = axes()
    pos: jax.Array = axes()
    key_valid: jax.Array = axes()
    rng: jax.Array = axes()
    block_nfe: jax.Array = axes()
    k_cache: Optional[jax.Array] = axes((None, "data", "model"), default=None)
    v_cache: Optional[jax.Array] = axes((None, "data", "model"), default=None)
    polestar: Optional[Any] = flax.struct.field(default=None)


# ------------------------------------------------------------------------------------ declared axes
class Axes:
    """The declared mesh axes of one array leaf (an opaque pytree leaf)."""

    def __init__(self, spec: tuple, select: bool = True):
        self.spec, self.select = tuple(spec), select

    @property
    def batch(self) -> int:
        """Index of the batch dimension."""
        return self.spec.index("data")

    def __repr__(self):
        return f"Axes{self.spec}"


def axes_of(tree: Any) -> Any:
    """A pytree like ``tree`` (a state dataclass, or any pytree whose leaves lead with the batch, such as
    a Replay) with an :class:`Axes` in place of every array leaf."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        out = {}
        for f in dataclasses.fields(tree):
            v = getattr(tree, f.name)
            if v is None or not f.metadata.get("pytree_node", True):
                out[f.name] = v
            elif "axes" in f.metadata:
                out[f.name] = jax.tree.map(lambda _: Axes(f.metadata["axes"], f.metadata["select"]), v)
            else:
                out[f.name] = axes_of(v)
        return tree.replace(**out)
    return jax.tree.map(lambda leaf: Axes(BATCH[: min(1, len(getattr(leaf, "shape", ())))]), tree)


def select_rows(active: jax.Array, new: Any, old: Any) -> Any:
    """Per batch row: ``new`` where ``active`` [b], else ``old`` (a finished row waits unchanged); fields
    declared ``select=False`` take ``new`` as is."""

    def sel(n, o, ax: Axes):
        if not ax.select:
            return n
        shape = [1] * n.ndim
        shape[ax.batch] = active.shape[0]
        return jnp.where(active.reshape(shape), n, o)

    return jax.tree.map(sel, new, old, axes_of(new))


# ---------------------------------------------------------------------------------------- building
def seed_key_data(seed: int) -> np.ndarray:
    """The key data of ``jax.random.PRNGKey(seed)`` (threefry: [high 32 bits, low 32 bits]) computed in
    numpy, so states can be built under tracing (``jax.eval_shape``) too."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return np.asarray([(s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF], np.uint32)


def row_key_data(seed: int, row: int) -> np.ndarray:
    """The key data of row ``row`` of a job seeded with ``seed``: ``[seed, row]`` as two uint32 words (a
    threefry key; for seed 0 it is ``jax.random.PRNGKey(row)``). A row's randomness (sampling noise, Polestar's
    k-means draws) depends on the job seed and its index in the job only, never on the batch it is decoded
    in; distinct (seed, row) pairs never share a key. Both must lie in [0, 2^32)."""
    for name, v in (("seed", seed), ("row index", row)):
        if not 0 <= int(v) < 2 ** 32:
            raise PolestarError(f"{name} must be in [0, 2^32), got {v}")
    return np.asarray([int(seed), int(row)], np.uint32)


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
    seeds: Sequence,  # per row: key data [2] (row_key_data) or an int seed (jax.random.PRNGKey(seed))
    cache: bool,
    dtype=jnp.float32,
) -> DecodeState:
    """The common part of the state: prompts left-padded into ``prompt_slot`` slots, ``gen_length`` masks
    after, and (``cache``) an empty K/V cache. Use :func:`init_decode_state` for a whole decoder state."""
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
    rng = np.stack([np.asarray(s, np.uint32) if np.ndim(s) else seed_key_data(s) for s in seeds])
    k_cache = v_cache = None
    if cache:
        from polestar_jax.family import family_of

        shape = family_of(cfg).cache_shape(cfg, b, length)
        k_cache = jnp.zeros(shape, dtype)
        v_cache = jnp.zeros(shape, dtype)
    return DecodeState(
        x=jnp.asarray(x), commit_step=jnp.full((b, length), -1, jnp.int32), nfe=jnp.zeros((b,), jnp.int32),
        pos=jnp.asarray(pos), key_valid=jnp.asarray(key_valid), rng=jnp.asarray(rng),
        block_nfe=jnp.zeros((b, num_blocks), jnp.int32),
        k_cache=k_cache, v_cache=v_cache,
    )


def init_decode_state(
    mcfg: ModelConfig,
    dcfg: DecodeConfig,
    prompts: Sequence[Sequence[int]],
    prompt_slot: int,
    seed: int = 0,
    rows: Optional[Sequence[int]] = None,
    dtype=jnp.float32,
    abstract: bool = False,
    place: Optional[Callable[[DecodeState], DecodeState]] = None,
) -> DecodeState:
    """The whole decode state of ``dcfg``'s decoder for ``prompts``: the common part, the decoder's own
    state (Polestar's clusters, store and drift state), and the Polestar store placed where
    ``PolestarConfig.offload_hidden`` says (host memory). ``abstract=True`` returns ``jax.ShapeDtypeStruct``
    leaves only (memory planning, ahead-of-time compiles); ``place`` (e.g. sharding over a mesh) runs
    before the store placement. The engine, the memory planner and every bench build states here."""
    rows = list(range(len(prompts))) if rows is None else list(rows)
    seeds = [row_key_data(seed, r) for r in rows]

    def build() -> DecodeState:
        s = init_state(prompts, mcfg, dcfg.gen_length, prompt_slot, dcfg.num_blocks, seeds,
                       cache=dcfg.cache != "none", dtype=dtype)
        if dcfg.decoder == "polestar":
            from polestar_jax.polestar_state import init_polestar_state

            s = s.replace(polestar=init_polestar_state(mcfg, dcfg.polestar, len(prompts), s.x.shape[1],
                                                       dcfg.block_length, dcfg.num_blocks, dtype))
        return s

    if abstract:
        state = jax.eval_shape(build)
        if dcfg.decoder == "polestar" and dcfg.polestar.offload_hidden != "none":
            from polestar_jax.offload import abstract_store

            state = state.replace(polestar=state.polestar.replace(
                **dict(zip(("hs", "hs_scale"), abstract_store(state.polestar.hs, state.polestar.hs_scale)))))
        return state
    state = build()
    if place is not None:
        state = place(state)
    if state.polestar is not None and dcfg.polestar.offload_hidden != "none":
        from polestar_jax.offload import place_store

        hs, hs_scale = place_store(state.polestar.hs, state.polestar.hs_scale, dcfg.polestar)
        state = state.replace(polestar=state.polestar.replace(hs=hs, hs_scale=hs_scale))
    return state
