"""What the host reads of a running batch after a block, packed on the device and copied asynchronously.

After :meth:`RunningBatch.step <polestar_jax.engine.engine.RunningBatch.step>` dispatches block ``k``, a small
compiled program packs everything the host needs of its result into one int32 array ``[b, W]`` (each row's
block counter, number of blocks, stop flag, forwards, the generation region's tokens and commit steps, its
forwards per block and the policy's per-row statistics) and starts its copy to the host. The block program
donates its state, so block ``k + 1`` may be dispatched at once: the host reads block ``k``'s
:class:`BlockResult` (:meth:`PendingBlock.read`) while the device computes block ``k + 1``, and a block call
costs the larger of the host's work and the device's, not their sum.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from polestar_jax.decode.state import DecodeState

_FIELDS = ("block", "n_blocks", "stop", "nfe")  # [b] each


def _parts(state: DecodeState, prompt_slot: int, stats: Optional[dict]) -> list[tuple[str, jax.Array]]:
    """``(name, [b, w] int32)`` pieces of the snapshot, in packing order."""
    b = state.x.shape[0]
    parts = [(name, getattr(state, name).astype(jnp.int32).reshape(b, 1)) for name in _FIELDS]
    parts += [("tokens", state.x[:, prompt_slot:]), ("commit_step", state.commit_step[:, prompt_slot:]),
              ("block_nfe", state.block_nfe)]
    for name, a in sorted((stats or {}).items()):
        parts.append(("stats." + name, a.astype(jnp.int32).reshape(b, -1)))
    return parts


def pack(state: DecodeState, prompt_slot: int, stats: Optional[dict]) -> jax.Array:
    """[b, W] int32: the pieces of :func:`_parts` side by side (one array: one copy to the host)."""
    return jnp.concatenate([a for _, a in _parts(state, prompt_slot, stats)], axis=1)


def layout(state: DecodeState, prompt_slot: int, stats: Optional[dict]) -> tuple:
    """``((name, width, shape of one row), ...)`` of :func:`pack`'s columns (from shapes only)."""
    names: list[str] = []

    def arrays(s, st):
        parts = _parts(s, prompt_slot, st)
        names[:] = [name for name, _ in parts]
        return [a for _, a in parts]

    shapes = jax.eval_shape(arrays, state, stats)
    raw = {"stats." + k: tuple(v.shape[1:]) for k, v in (stats or {}).items()}
    return tuple((name, int(a.shape[1]), raw.get(name, (int(a.shape[1]),))) for name, a in zip(names, shapes))


@dataclasses.dataclass
class BlockResult:
    """A running batch's rows after one block, on the host (numpy).

    blocks [b] blocks decoded; done [b] the row has decoded all its blocks or stopped early; nfe [b];
    tokens, commit_step [b, G] the generation region; block_nfe [b, n_blocks]; stats: the policy's per-row
    statistics (None when it keeps none); tags: each slot's occupant when the block was dispatched (None:
    free), so a result is never read into a row that took the slot later."""

    blocks: np.ndarray
    done: np.ndarray
    nfe: np.ndarray
    tokens: np.ndarray
    commit_step: np.ndarray
    block_nfe: np.ndarray
    stats: Optional[dict]
    tags: tuple


def unpack(packed: np.ndarray, cols: tuple, tags: Sequence[Any]) -> BlockResult:
    """The :class:`BlockResult` of a host copy of :func:`pack`'s array laid out as ``cols`` (:func:`layout`)."""
    out, at = {}, 0
    for name, width, shape in cols:
        out[name] = packed[:, at: at + width].reshape((packed.shape[0],) + shape)
        at += width
    stats = {k[len("stats."):]: v for k, v in out.items() if k.startswith("stats.")} or None
    blocks, n, stop = out["block"][:, 0], out["n_blocks"][:, 0], out["stop"][:, 0].astype(bool)
    return BlockResult(blocks=blocks, done=(blocks >= n) | stop, nfe=out["nfe"][:, 0], tokens=out["tokens"],
                       commit_step=out["commit_step"], block_nfe=out["block_nfe"], stats=stats, tags=tuple(tags))


class PendingBlock:
    """A dispatched block's packed result on its way to the host; :meth:`read` waits for it (once)."""

    def __init__(self, packed: jax.Array, cols: tuple, tags: Sequence[Any]):
        self._packed, self._cols, self._tags = packed, cols, tuple(tags)
        self._result: Optional[BlockResult] = None
        packed.copy_to_host_async()

    def read(self) -> BlockResult:
        """The block's :class:`BlockResult` (a host sync the first time: the block must have run)."""
        if self._result is None:
            self._result = unpack(np.asarray(self._packed), self._cols, self._tags)
            self._packed = None
        return self._result

