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

import functools
from typing import Any, NamedTuple, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from polestar_jax.axes import BATCH, LAYER_BATCH, Axes, axes, axes_of, select_rows  # noqa: F401 (re-exported)
from polestar_jax.config import DecodeConfig, ModelConfig
from polestar_jax.errors import PolestarError

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
    block        [b]    int32   the row's next block (per-row progress: rows of a batch may sit at different blocks).
    n_blocks     [b]    int32   the row's number of blocks (its generation length / block length; 0: a free slot).
    stop         [b]    bool    the row ended early: a finished block held one of the stop tokens (early exit).
    k_cache, v_cache  [N, b, KV, L, hd] or None: un-rotated K/V of the last full pass / step.
    polestar     Polestar's clusters, hidden states and drift state
                 (:class:`polestar_jax.decode.polestar.state.PolestarState`, decoder "polestar"), else None.
    """

    x: jax.Array = axes()
    commit_step: jax.Array = axes()
    nfe: jax.Array = axes()
    pos: jax.Array = axes()
    key_valid: jax.Array = axes()
    rng: jax.Array = axes()
    block_nfe: jax.Array = axes()
    block: jax.Array = axes()
    n_blocks: jax.Array = axes()
    stop: jax.Array = axes()
    k_cache: Optional[jax.Array] = axes((None, "data", "model"), default=None)
    v_cache: Optional[jax.Array] = axes((None, "data", "model"), default=None)
    polestar: Optional[Any] = flax.struct.field(default=None)


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


class PromptFields(NamedTuple):
    """The prompt-dependent fields of a state, as host arrays (everything else starts as zeros)."""

    x: np.ndarray  # [b, L] int32
    pos: np.ndarray  # [b, L] int32
    key_valid: np.ndarray  # [b, L] bool
    rng: np.ndarray  # [b, 2] uint32
    n_blocks: np.ndarray  # [b] int32 each row's number of blocks


class StateLayout(NamedTuple):
    """What besides the prompts fixes a state's fields and shapes (hashable: one compiled builder each)."""

    model: ModelConfig
    num_blocks: int
    cache: bool  # K/V cache fields
    dtype: Any  # model dtype (numpy dtype)
    block_length: int = 0
    polestar: Optional[Any] = None  # a PolestarConfig: Polestar's state too


def prompt_fields(prompts: Sequence[Sequence[int]], cfg: ModelConfig, gen_length: int, prompt_slot: int,
                  seeds: Sequence, block_length: int = 0,
                  gen_lengths: Optional[Sequence[int]] = None) -> PromptFields:
    """Prompts left-padded into ``prompt_slot`` slots with ``gen_length`` masks after, their RoPE positions,
    key validity and per-row keys (``seeds``: per row key data [2] (:func:`row_key_data`) or an int seed
    (``jax.random.PRNGKey(seed)``)), in numpy. ``gen_lengths`` (per row, multiples of ``block_length`` up to
    ``gen_length``; default ``gen_length``): a shorter row's positions after its own generation are hidden
    from attention (``key_valid`` False), so it computes what it would with a region of its own length."""
    b = len(prompts)
    length = prompt_slot + gen_length
    gens = np.full((b,), gen_length, np.int32) if gen_lengths is None else np.asarray(gen_lengths, np.int32)
    x = np.full((b, length), cfg.mask_token_id, np.int32)
    pad = np.zeros((b,), np.int32)
    for r, p in enumerate(prompts):
        pad[r] = prompt_slot - len(p)
        x[r, : pad[r]] = cfg.pad_token_id
        x[r, pad[r]: prompt_slot] = np.asarray(p, np.int32)
    idx = np.arange(length, dtype=np.int32)[None, :]
    rng = np.stack([np.asarray(s, np.uint32) if np.ndim(s) else seed_key_data(s) for s in seeds])
    valid = (idx >= pad[:, None]) & (idx < prompt_slot + gens[:, None])
    n_blocks = gens // block_length if block_length else np.zeros((b,), np.int32)
    return PromptFields(x, idx - pad[:, None], valid, rng, n_blocks.astype(np.int32))


def build_state(fields: PromptFields, layout: StateLayout) -> DecodeState:
    """The initial state of ``layout`` around ``fields`` (traceable: a jitted builder places every field
    on its shards directly)."""
    b, length = fields.x.shape
    k_cache = v_cache = None
    if layout.cache:
        from polestar_jax.models.family import family_of

        shape = family_of(layout.model).cache_shape(layout.model, b, length)
        k_cache = jnp.zeros(shape, layout.dtype)
        v_cache = jnp.zeros(shape, layout.dtype)
    state = DecodeState(
        x=jnp.asarray(fields.x), commit_step=jnp.full((b, length), -1, jnp.int32), nfe=jnp.zeros((b,), jnp.int32),
        pos=jnp.asarray(fields.pos), key_valid=jnp.asarray(fields.key_valid), rng=jnp.asarray(fields.rng),
        block_nfe=jnp.zeros((b, layout.num_blocks), jnp.int32), block=jnp.zeros((b,), jnp.int32),
        n_blocks=jnp.asarray(fields.n_blocks), stop=jnp.zeros((b,), bool), k_cache=k_cache, v_cache=v_cache,
    )
    if layout.polestar is not None:
        from polestar_jax.decode.polestar.state import init_polestar_state

        state = state.replace(polestar=init_polestar_state(layout.model, layout.polestar, b, length,
                                                           layout.block_length, layout.num_blocks, layout.dtype))
    return state


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
    return build_state(prompt_fields(prompts, cfg, gen_length, prompt_slot, seeds, gen_length // num_blocks),
                       StateLayout(cfg, num_blocks, cache, np.dtype(dtype)))


def build_sharded(fields: PromptFields, layout: StateLayout, mesh, builders: Optional[dict] = None) -> DecodeState:
    """:func:`build_state` as one compiled program whose outputs carry their mesh shardings
    (:func:`polestar_jax.sharding.state_shardings`): every device creates only its own shards, so a large
    K/V cache or Polestar store never exists whole on one device. The small prompt fields are placed on
    their shards first (:func:`polestar_jax.sharding.shard`, multi-process safe). ``builders``: a dict the
    caller owns (an :class:`polestar_jax.engine.engine.Engine`'s) that keeps one builder per (layout, mesh, shapes);
    None builds one for this call."""
    from polestar_jax.sharding import shard, state_shardings

    key = ("state builder", layout, mesh, fields.x.shape)
    if builders is None or key not in builders:
        out = state_shardings(jax.eval_shape(functools.partial(build_state, layout=layout), fields), mesh)
        built = (jax.jit(build_state, static_argnums=1, out_shardings=out),
                 PromptFields(out.x, out.pos, out.key_valid, out.rng, out.n_blocks))
        if builders is None:
            fn, field_shardings = built
            return fn(shard(fields, field_shardings), layout)
        builders[key] = built
    fn, field_shardings = builders[key]
    return fn(shard(fields, field_shardings), layout)


def init_decode_state(
    mcfg: ModelConfig,
    dcfg: DecodeConfig,
    prompts: Sequence[Sequence[int]],
    prompt_slot: int,
    seed: int = 0,
    rows: Optional[Sequence[int]] = None,
    dtype=jnp.float32,
    abstract: bool = False,
    mesh=None,
    gen_lengths: Optional[Sequence[int]] = None,
    builders: Optional[dict] = None,
) -> DecodeState:
    """The whole decode state of ``dcfg``'s decoder for ``prompts``: the common part, the decoder's own
    state (Polestar's clusters, store and drift state), and the Polestar store placed where
    ``PolestarConfig.offload_hidden`` says (host memory). ``abstract=True`` returns ``jax.ShapeDtypeStruct``
    leaves only (memory planning, ahead-of-time compiles). ``mesh`` (a ``jax.sharding.Mesh``): the state is
    built already sharded over it (:func:`build_sharded`, its builder kept in ``builders`` when given). The engine, the memory planner and every bench
    build states here."""
    rows = list(range(len(prompts))) if rows is None else list(rows)
    fields = prompt_fields(prompts, mcfg, dcfg.gen_length, prompt_slot, [row_key_data(seed, r) for r in rows],
                           dcfg.block_length, gen_lengths)
    polestar = dcfg.decoder == "polestar"
    layout = StateLayout(mcfg, dcfg.num_blocks, dcfg.cache != "none", np.dtype(dtype), dcfg.block_length,
                         dcfg.polestar if polestar else None)
    offload = polestar and dcfg.polestar.offload_hidden != "none"
    if abstract:
        state = jax.eval_shape(functools.partial(build_state, layout=layout), fields)
        if offload:
            from polestar_jax.decode.polestar.offload import abstract_store

            state = state.replace(polestar=state.polestar.replace(
                **dict(zip(("hs", "hs_scale"), abstract_store(state.polestar.hs, state.polestar.hs_scale)))))
        return state
    state = build_state(fields, layout) if mesh is None else build_sharded(fields, layout, mesh, builders)
    if offload:
        from polestar_jax.decode.polestar.offload import place_store

        hs, hs_scale = place_store(state.polestar.hs, state.polestar.hs_scale, dcfg.polestar)
        state = state.replace(polestar=state.polestar.replace(hs=hs, hs_scale=hs_scale))
    return state
