"""What the task benchmarks share: the repository paths, the trained model and its layout, the prompt slot,
and padded batching with job-wide row indices.

:mod:`bench.run` and :mod:`bench.bench_refresh` both decode held-out task instances in fixed-size batches on
one compiled executable; the helpers here are that code, once:

* :func:`load_bench_model`: parameters, tokenizer and generation layout of a model folder (default: the
  bundled ``tiny_tasks`` model);
* :func:`prompt_slot`: the longest prompt rounded up to a multiple of 16 (one slot for the whole job);
* :func:`padded_batches` / :func:`decode_batches`: the job split into batches of exactly ``batch`` rows, the
  last one padded with copies of its first prompt, every prompt decoded as row ``i`` of the job (its index
  in the prompt list: ``generate(..., rows=...)``), so its randomness -- Polestar's k-means draws, any
  sampling -- and so its tokens do not depend on the batch size or on where it lands in a batch.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Iterator, Optional, Sequence

from polestar_jax.io.checkpoint import generation_defaults, load_model
from polestar_jax.config import DecodeConfig, ModelConfig
from polestar_jax.engine.engine import Engine, GenerateResult
from polestar_jax.engine.engine import prompt_slot as engine_prompt_slot
from polestar_jax.errors import PolestarError
from polestar_jax.io.tokenizer import Tokenizer, bundled_model_dir, load_tokenizer

__all__ = ["REPO_ROOT", "RESULTS_DIR", "BenchModel", "load_bench_model", "prompt_slot", "padded_batches",
           "decode_batches"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where the benchmarks write by default (git-ignored; published runs are copied to ``bench/published``).
RESULTS_DIR = os.path.join(REPO_ROOT, "bench", "results")
#: Prompt slots are multiples of this (one executable per slot).
SLOT_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class BenchModel:
    """A loaded model folder and the generation layout it was trained for (``generation_config.json``)."""

    model_dir: str
    mcfg: ModelConfig
    params: object
    tok: Tokenizer
    gen_length: int
    block_length: int
    engine: Engine  # decodes every job of this model (owns the compiled programs)


def load_bench_model(model: Optional[str] = None, gen_length: Optional[int] = None,
                     block_length: Optional[int] = None, mesh=None) -> BenchModel:
    """Loads ``model`` (a folder; None or "" = the bundled ``tiny_tasks`` model) with its tokenizer; gen and
    block length default to the folder's generation defaults (32 / 8 if it has none). With a ``mesh``
    (``jax.sharding.Mesh``) the parameters are built shard by shard with the mesh's shardings."""
    model_dir = model or bundled_model_dir()
    mcfg, params = load_model(model_dir, shardings=mesh)
    tok = load_tokenizer(model_dir)
    gd = generation_defaults(model_dir)
    gen = gen_length if gen_length is not None else gd.get("gen_length", 32)
    block = block_length if block_length is not None else gd.get("block_length", 8)
    if gen <= 0 or block <= 0 or gen % block:
        raise PolestarError(f"gen length {gen} must be a positive multiple of block length {block}")
    return BenchModel(model_dir, mcfg, params, tok, gen, block, Engine(params, mcfg, tok, mesh=mesh))


def prompt_slot(prompts: Sequence[Sequence[int]], multiple: int = SLOT_MULTIPLE) -> int:
    """The prompt slot of a job: its longest prompt rounded up to ``multiple`` (the engine's rule,
    :func:`polestar_jax.engine.engine.prompt_slot`)."""
    return engine_prompt_slot([len(p) for p in prompts], multiple)


def padded_batches(prompts: Sequence[Sequence[int]], batch: int) -> Iterator[tuple[int, list, list[int]]]:
    """``(n_real, prompts, rows)`` per batch of exactly ``batch`` rows: the job's prompts in order, the last
    batch padded with copies of its first prompt (their row index too: a padding row computes what that row
    computes, and is dropped). ``rows`` are the prompts' indices in the job."""
    if batch <= 0:
        raise PolestarError(f"batch must be positive, got {batch}")
    for i in range(0, len(prompts), batch):
        chunk = list(prompts[i:i + batch])
        rows = list(range(i, i + len(chunk)))
        pad = batch - len(chunk)
        yield len(chunk), chunk + [chunk[0]] * pad, rows + [rows[0]] * pad


def decode_batches(engine: Engine, prompts: Sequence[Sequence[int]], dcfg: DecodeConfig, batch: int,
                   slot: int, seed: int = 0) -> Iterator[tuple[int, int, GenerateResult]]:
    """Decodes the job in fixed, padded batches (:func:`padded_batches`) at prompt slot ``slot`` on
    ``engine`` (:meth:`Engine.run`, per-step statistics included); yields ``(first_row, n_real, result)`` per
    batch (``result`` has ``batch`` rows, the first ``n_real`` real)."""
    start = 0
    for n_real, chunk, rows in padded_batches(prompts, batch):
        res = engine.run(chunk, dcfg, seed=seed, rows=rows, prompt_slot=slot)
        yield start, n_real, res
        start += n_real
