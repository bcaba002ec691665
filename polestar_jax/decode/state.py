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
from typing import Any, Callable, NamedTuple, Optional, Sequence

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
    k_cache, v_cache  [N, b, KV, L, hd] or None: K/V of the last full pass / step (keys un-rotated for
                 Polestar, rotated for the Fast-dLLM caches: docs/differences.md#d46); with
                 ``kv_cache="int8"`` each a ``QTensor`` (int8 [N, b, KV, L, hd] and scales [N, b, KV, L, 1]:
                 :mod:`polestar_jax.models.kv_quant`), both arrays with the same declared axes.
    policy_state the decoding policy's own part (:class:`PolicyState` hooks build and place it; Polestar's
                 clusters, hidden-state store and drift state), or None for a policy that keeps none.
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
    # (select=False: a step writes K/V only for its active rows, so a finished row's cache is never copied
    # whole to keep it; a row that is not live is never read again before a full pass rewrites its cache)
    k_cache: Optional[jax.Array] = axes((None, "data", "model"), select=False, default=None)
    v_cache: Optional[jax.Array] = axes((None, "data", "model"), select=False, default=None)
    policy_state: Optional[Any] = flax.struct.field(default=None)


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct``: shapes and dtypes only)."""
    return int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


class PolicyState(NamedTuple):
    """The hooks through which a policy keeps its own part of the decode state (``DecodeState.policy_state``):
    the generic state, the block program, the engine and the memory plan call these and name no policy.
    ``config`` is the policy's part of the decode configuration (hashable; e.g. a ``PolestarConfig``).

    config_of(dcfg, platform) -> config   the policy's settings in a ``DecodeConfig``, for programs compiled
                                          for ``platform`` (None: the default backend's)
    init(layout, b, length) -> part       the empty part for ``b`` rows of ``length`` (traceable)
    place(part, config, abstract) -> part outside jit: the part moved where it lives (host memory, say);
                                          ``abstract``: the same for ``jax.ShapeDtypeStruct`` leaves
    at_rest(part, spec) -> part           inside a program: the part where it lives between blocks
    reshape(leaf, shape, spec) -> leaf    inside a program: a leaf declared ``select=False`` reshaped where it lives
    compactable(spec) -> bool             rows of the part may be gathered into a smaller batch (device memory)
    stats(part) -> {name: [b, ...]}       the per-row statistics the engine reports
    memory(part, batch, config) -> dict   per-sequence bytes for the memory plan: ``stored`` (a store that may
                                          live in host memory), ``other``, ``stored_memory`` (its memory kind) and
                                          ``transient`` (device bytes the store needs while a layer runs)
    """

    config_of: Callable[..., Any]
    init: Callable[..., Any]
    place: Callable[[Any, Any, bool], Any]
    at_rest: Callable[[Any, Any], Any]
    reshape: Callable[[jax.Array, tuple, Any], jax.Array]
    compactable: Callable[[Any], bool]
    stats: Callable[[Any], dict]
    memory: Callable[[Any, int, Any], dict]


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
    own: Optional[PolicyState] = None  # the policy's hooks, when it keeps a state of its own
    own_config: Any = None  # their config (PolicyState.config_of)
    kv_cache: str = "float"  # DecodeConfig.kv_cache: the K/V cache's storage (float: in ``dtype``; int8)


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
        from polestar_jax.models import kv_quant
        from polestar_jax.models.family import family_of

        shape = family_of(layout.model).cache_shape(layout.model, b, length)
        k_cache = kv_quant.empty(shape, layout.dtype, layout.kv_cache)
        v_cache = kv_quant.empty(shape, layout.dtype, layout.kv_cache)
    state = DecodeState(
        x=jnp.asarray(fields.x), commit_step=jnp.full((b, length), -1, jnp.int32), nfe=jnp.zeros((b,), jnp.int32),
        pos=jnp.asarray(fields.pos), key_valid=jnp.asarray(fields.key_valid), rng=jnp.asarray(fields.rng),
        block_nfe=jnp.zeros((b, layout.num_blocks), jnp.int32), block=jnp.zeros((b,), jnp.int32),
        n_blocks=jnp.asarray(fields.n_blocks), stop=jnp.zeros((b,), bool), k_cache=k_cache, v_cache=v_cache,
    )
    if layout.own is not None:
        state = state.replace(policy_state=layout.own.init(layout, b, length))
    return state


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
