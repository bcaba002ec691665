"""The public ``generate()`` API: prompts in, tokens and statistics out (no I/O, no CLI).

The host loop runs over blocks only; each block is one compiled call of the block program
(:func:`polestar_jax.block.decode_block`)
dispatched asynchronously, so the host never waits for the device inside a generation; results are read
once at the end.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from polestar_jax.config import DecodeConfig, ModelConfig
from polestar_jax.errors import PolestarError
from polestar_jax.block import EngineSpec, Knobs, decode_block, run_block_jit
from polestar_jax.polestar_state import STAT_FIELDS
from polestar_jax.state import DecodeState, init_decode_state, padded_length


@dataclasses.dataclass
class GenerateResult:
    """Output of :func:`generate` for a batch of b prompts.

    tokens       [b, G] int   generated tokens (the block region, after the prompt).
    commit_step  [b, G] int   which forward of the row committed each token.
    nfe          [b]    int   forwards per row.
    block_nfe    [b, n_blocks] int  forwards per row and block.
    seconds      float        wall time of the decode loop (first dispatch to results on the host),
                              compile excluded; ``compile_seconds``: time spent compiling for this call.
    """

    tokens: np.ndarray
    commit_step: np.ndarray
    nfe: np.ndarray
    block_nfe: np.ndarray
    seconds: float
    compile_seconds: float = 0.0
    dispatch_seconds: float = 0.0  # host time spent enqueueing the blocks (the rest of `seconds` is device work)
    polestar: Optional[dict] = None  # decoder "polestar": per-row stats arrays (polestar_state.STAT_FIELDS)
    steps: Optional[list] = None  # decoder "polestar": per block, the StepOut buffer (numpy)

    def block_stats(self, row: int) -> list[dict]:
        """Per processed block: ``block_id``, ``block_nfe`` and (Polestar) the full pass, windowed pass and
        refresh steps of the block, under the names of the PyTorch code's ``block_stats`` (``block0_true``,
        ``efficient_true``, ``cluster_true``: the golden format)."""
        out = []
        for blk in range(self.block_nfe.shape[1]):
            if self.polestar is not None:
                if not self.polestar["processed"][row, blk]:
                    continue
                out.append({"block_id": blk, "block_nfe": int(self.block_nfe[row, blk]),
                            "block0_true": int(self.polestar["full_pass"][row, blk]),
                            "efficient_true": int(self.polestar["windowed"][row, blk]),
                            "cluster_true": int(self.polestar["refresh_steps"][row, blk])})
            else:
                out.append({"block_id": blk, "block_nfe": int(self.block_nfe[row, blk])})
        return out

    def trajectory(self, row: int) -> list[list[tuple[int, int]]]:
        """Per forward, the (position within the generation, token) pairs committed, in position order."""
        n = int(self.nfe[row])
        out: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for j, (s, t) in enumerate(zip(self.commit_step[row], self.tokens[row])):
            if 0 <= s < n:
                out[s].append((j, int(t)))
        return out

    def commits_per_forward(self, row: int) -> list[int]:
        return [len(t) for t in self.trajectory(row)]


_COMPILED: dict = {}


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple((tuple(a.shape), str(a.dtype), getattr(a, "sharding", None)) for a in leaves))


def compiled_block(params, state: DecodeState, knobs: Knobs, spec: EngineSpec, replay=None):
    """The compiled block decoder for these shapes, compiling it on first use.

    Returns ``(fn, compile_seconds)``; ``fn(params, state, block_idx, knobs, replay) -> (state, steps)``. Executables are
    cached per (spec, parameter and state shapes/dtypes), so a second prompt of the same padded length
    reuses the executable (``compile_seconds`` is then 0). :func:`compile_cache_size` exposes the count.
    """
    key = (spec, _signature(params), _signature(state), _signature(replay))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    t0 = time.perf_counter()
    jitted = run_block_jit
    mesh = _mesh_of(state)
    if mesh is not None:
        # keep the state's sharding across blocks: outputs are constrained to the input layout
        from jax.sharding import NamedSharding, PartitionSpec

        out = jax.eval_shape(lambda p, s, r: decode_block(p, s, jnp.int32(0), knobs, r, spec), params, state, replay)
        rep = NamedSharding(mesh, PartitionSpec())
        out_sh = (jax.tree.map(lambda a: a.sharding, state), jax.tree.map(lambda _: rep, out[1]))
        jitted = jax.jit(decode_block, static_argnames=("spec",), donate_argnames=("state",), out_shardings=out_sh)
    fn = jitted.lower(params, state, jnp.int32(0), knobs, replay, spec).compile()
    _COMPILED[key] = fn
    return fn, time.perf_counter() - t0


def _mesh_of(tree):
    for leaf in jax.tree.leaves(tree):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None and getattr(mesh, "size", 1) > 1:
            return mesh
    return None


def compile_cache_size() -> int:
    """Number of block-decoder executables compiled so far in this process."""
    return len(_COMPILED)


def check_prompts(prompts: Sequence[Sequence[int]], mcfg: ModelConfig, dcfg: DecodeConfig) -> None:
    """Raises :class:`PolestarError` for empty prompts, out-of-vocabulary ids or too long sequences."""
    if len(prompts) == 0:
        raise PolestarError("no prompt given")
    for r, p in enumerate(prompts):
        if len(p) == 0:
            raise PolestarError(f"prompt {r} is empty")
        if len(p) + dcfg.gen_length > mcfg.max_sequence_length:
            raise PolestarError(
                f"prompt {r} has {len(p)} tokens; with gen length {dcfg.gen_length} that exceeds the model's "
                f"max_sequence_length {mcfg.max_sequence_length}")
        a = np.asarray(p)
        if a.min() < 0 or a.max() >= mcfg.embedding_size:
            raise PolestarError(f"prompt {r} has token ids outside [0, {mcfg.embedding_size})")


def generate(
    params,
    mcfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    dcfg: DecodeConfig,
    seed: int = 0,
    rows: Optional[Sequence[int]] = None,
    pad_multiple: int = 16,
    prompt_slot: Optional[int] = None,
    replay=None,
    mesh=None,
) -> GenerateResult:
    """Generates ``dcfg.gen_length`` tokens after each prompt.

    params:  the parameter pytree of :mod:`polestar_jax.model`.
    prompts: b token-id lists (any lengths); they are left-padded to ``prompt_slot`` (default: the longest
             rounded up to ``pad_multiple``), so prompts of one bucket share one compiled executable.
    seed:    the job seed; keys the sampling noise and Polestar's k-means draws together with ``rows``.
    rows:    each prompt's index in the job (default ``0..b-1``): prompt r's randomness is derived from
             ``(seed, rows[r])`` only (:func:`polestar_jax.state.row_key_data`), so a prompt decodes the same
             whatever batch or position it is decoded in; pass the global indices when a job is split
             into batches.
    replay:  (Polestar) a :class:`polestar_jax.draws.Replay` of decisions taken from a PyTorch trace.
    mesh:    a ``jax.sharding.Mesh`` with axes (data, model): parameters and state are sharded over it
             (see :mod:`polestar_jax.sharding`); None runs on the default device.
    """
    check_prompts(prompts, mcfg, dcfg)
    slot = prompt_slot or padded_length([len(p) for p in prompts], pad_multiple)
    if slot < max(len(p) for p in prompts):
        raise PolestarError(f"prompt_slot {slot} is shorter than the longest prompt")
    rows = list(range(len(prompts))) if rows is None else [int(r) for r in rows]
    if len(rows) != len(prompts):
        raise PolestarError(f"rows has {len(rows)} entries for {len(prompts)} prompts")
    if not isinstance(seed, (int, np.integer)):
        raise PolestarError(f"seed must be an integer, got {seed!r}")
    spec = EngineSpec.from_config(mcfg, dcfg)
    knobs = Knobs.from_config(dcfg)
    dtype = jax.tree.leaves(params)[0].dtype
    if mesh is not None:
        from polestar_jax import sharding

        params = sharding.shard(params, sharding.param_shardings(params, mesh, mcfg))  # whole heads (GQA)
        if replay is not None:
            replay = sharding.shard(replay, sharding.state_shardings(replay, mesh))
    state = init_decode_state(mcfg, dcfg, prompts, slot, seed=seed, rows=rows, dtype=dtype, mesh=mesh)
    fn, compile_seconds = compiled_block(params, state, knobs, spec, replay)
    t0 = time.perf_counter()
    steps = []
    for blk in range(dcfg.num_blocks):  # dispatched asynchronously: no host sync inside the loop
        state, st = fn(params, state, jnp.int32(blk), knobs, replay)
        steps.append(st)
    dispatch_seconds = time.perf_counter() - t0  # host time to enqueue every block
    from polestar_jax.sharding import to_host

    # only what the result reports: not the Polestar store, clusters or proxy attention
    stats = None if state.polestar is None else {k: getattr(state.polestar, k) for k in STAT_FIELDS}
    x, cstep, nfe, bnfe, pol, steps = to_host((state.x, state.commit_step, state.nfe, state.block_nfe, stats, steps))
    seconds = time.perf_counter() - t0
    pstats = None if pol is None else {k: np.asarray(v) for k, v in pol.items()}
    return GenerateResult(tokens=np.asarray(x[:, slot:]), commit_step=np.asarray(cstep[:, slot:]),
                          nfe=np.asarray(nfe), block_nfe=np.asarray(bnfe), seconds=seconds,
                          compile_seconds=compile_seconds, dispatch_seconds=dispatch_seconds, polestar=pstats,
                          steps=steps if pol is not None else None)
