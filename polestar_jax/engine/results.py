"""What the engine returns: a fixed batch's :class:`GenerateResult`, a finished row's :class:`RowOutput`,
its accounted :class:`Completion` (response cut at the stop tokens, non-EOS tokens, TPF, the policy's
counters) and a continuous job's :class:`JobResult`. Plain host data (numpy, ints): nothing here touches a
device.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import numpy as np

from polestar_jax.config import DecodeConfig


@dataclasses.dataclass
class GenerateResult:
    """Output of :meth:`Engine.run` for a fixed batch of b prompts.

    tokens       [b, G] int   generated tokens (the block region, after the prompt); blocks a row never
                              decoded (early exit) hold the mask id.
    commit_step  [b, G] int   which forward of the row committed each token (-1: never).
    nfe          [b]    int   forwards per row.
    block_nfe    [b, n_blocks] int  forwards per row and block.
    blocks       [b]    int   blocks each row decoded (all of them unless it stopped early).
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
    blocks: Optional[np.ndarray] = None

    def block_stats(self, row: int) -> list[dict]:
        """Per processed block: ``block_id``, ``block_nfe`` and (Polestar) the full pass, windowed pass and
        refresh steps of the block, under the names of the PyTorch code's ``block_stats`` (``block0_true``,
        ``efficient_true``, ``cluster_true``: the golden format)."""
        out = []
        n_blocks = self.block_nfe.shape[1] if self.blocks is None else int(self.blocks[row])
        for blk in range(n_blocks):
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

    def row(self, r: int, index: Optional[int] = None) -> "RowOutput":
        """Row ``r`` as a :class:`RowOutput` (``index``: its index in the job)."""
        blocks = self.block_nfe.shape[1] if self.blocks is None else int(self.blocks[r])
        n = blocks * (self.tokens.shape[1] // max(1, self.block_nfe.shape[1]))
        pol = None if self.polestar is None else {k: np.asarray(v[r]) for k, v in self.polestar.items()}
        return RowOutput(index=r if index is None else index, tokens=np.asarray(self.tokens[r, :n]),
                         commit_step=np.asarray(self.commit_step[r, :n]), nfe=int(self.nfe[r]),
                         block_nfe=np.asarray(self.block_nfe[r, :blocks]), polestar=pol)


@dataclasses.dataclass
class RowOutput:
    """One decoded prompt, as the engine returns it (token ids; :meth:`Engine.completion` does the accounting).

    index        the prompt's index in the job (its randomness comes from (seed, index))
    tokens       [n] int  the generated ids of the blocks the row decoded (n = blocks x block length)
    commit_step  [n] int  which of the row's forwards committed each id
    nfe          forwards the row ran
    block_nfe    [blocks] forwards per decoded block
    polestar     decoder polestar: the row's statistics (``polestar_state.STAT_FIELDS``), else None
    seconds      (continuous jobs) wall seconds from the row's insertion to its results on the host
    """

    index: int
    tokens: np.ndarray
    commit_step: np.ndarray
    nfe: int
    block_nfe: np.ndarray
    polestar: Optional[dict] = None
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Completion:
    """The accounting of one row: its response and the numbers ``bench.run``, the API and the server report.

    response_ids    the generated ids up to the first stop token (EOS, pad, end of turn)
    non_eos_tokens  generated ids (of the decoded blocks) that are not EOS / pad: TPF's numerator
    nfe, tpf        forwards, and non_eos_tokens / nfe
    stats           decoder polestar: refresh_steps, early_commits, suffix_commits, windowed_passes; else {}
    finish_reason   "stop" (a stop token ended the response) or "length" (it ran to its last block)
    """

    response_ids: list
    non_eos_tokens: int
    nfe: int
    tpf: float
    stats: dict
    finish_reason: str


def polestar_stats(ps: Optional[dict], r: Optional[int] = None) -> dict:
    """Polestar's counters of one row (``ps``: per-row stats, or batch stats with ``r``): refresh steps,
    early and suffix commits, windowed block starts."""
    if ps is None:
        return {}

    def total(name):
        a = np.asarray(ps[name]) if name in ps else np.zeros(1)
        return int((a if r is None else a[r]).sum())

    return {"refresh_steps": total("refresh_steps"), "early_commits": total("early"),
            "suffix_commits": total("suffix"), "windowed_passes": total("windowed")}


@dataclasses.dataclass
class JobResult:
    """A continuous job's rows (in prompt order) and totals.

    seconds          decode seconds (first dispatch to the last row on the host), compile apart
    compile_seconds  seconds spent compiling for this job
    block_calls      block-program calls dispatched
    """

    rows: list
    decode: DecodeConfig
    seconds: float
    compile_seconds: float
    batch_size: int
    prompt_slot: int
    block_calls: int
    wall_seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[RowOutput]:
        return iter(self.rows)

    def __getitem__(self, i) -> RowOutput:
        return self.rows[i]

    @property
    def nfe(self) -> int:
        return sum(r.nfe for r in self.rows)
