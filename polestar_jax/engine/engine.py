"""The decoding engine: one object that owns a loaded model's compiled block programs and runs jobs on them.

An :class:`Engine` is built from a loaded model (parameters, :class:`ModelConfig`, optionally its tokenizer
and a device mesh). It owns

* its compiled executables (the block program per decode structure and shape, the row-insertion program,
  the sharded state builders): per instance, bounded (least recently used first out), :meth:`Engine.clear`;
* the prompt-slot bucketing (:meth:`Engine.prompt_slot`: multiples of 16 tokens), so that jobs, the
  lm-eval harness and the server reuse a few executables;
* the accounting: the response cut at the family's stop tokens, non-EOS tokens, TPF and Polestar's
  statistics (:meth:`Engine.completion`).

Jobs run in one of two ways, with the same block program (:func:`polestar_jax.decode.block.decode_block`):

* :meth:`Engine.run`: a fixed batch; every block of every row is dispatched asynchronously and the results
  are read once at the end (the golden replays and ``crosscheck`` use this, with the per-step statistics);
* :meth:`Engine.generate`: a continuous job over any number of prompts: a :class:`RunningBatch` of
  ``batch_size`` slots in which every row advances by one block per call; a row leaves when it is done
  (its last block, or early exit: a finished block holding a stop token) and the next prompt takes its slot
  at the next block boundary, without recompiling. Prompt ``i``'s randomness comes from ``(seed, i)``, so
  its tokens do not depend on the batch, its slot or when it joined.
"""
from __future__ import annotations

import collections
import dataclasses
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from polestar_jax.compat import program_target
from polestar_jax.engine import executables, images as image_table, snapshot
from polestar_jax.decode.block import EngineSpec, Knobs, compact_width, decode_block
from polestar_jax.engine.compile_cache import CompileRecord, cache_hits
from polestar_jax.config import GPU_PLATFORMS, DecodeConfig, ModelConfig
from polestar_jax.errors import PolestarError
from polestar_jax.sharding import to_host
from polestar_jax.models import quant
from polestar_jax.decode.layout import init_decode_state, own_state, state_layout
from polestar_jax.engine.results import (Completion, GenerateResult, JobResult, RowOutput,  # noqa: F401 (re-exported)
                                        polestar_stats)
from polestar_jax.decode.state import DecodeState, PromptFields, StateLayout, axes_of, build_state, prompt_fields, row_key_data

#: Prompt slots are multiples of this many tokens (the default bucketing; see :meth:`Engine.prompt_slot`).
PAD_MULTIPLE = 16


def own_stats(state: DecodeState, decoder: str) -> Optional[dict]:
    """The per-row statistics of ``decoder``'s own state (:attr:`PolicyState.stats`: device arrays [b, ...]),
    or None for a policy that keeps none."""
    own = own_state(decoder)
    return None if own is None or state.policy_state is None else own.stats(state.policy_state)


def check_prompts(prompts: Sequence[Sequence[int]], mcfg: ModelConfig, dcfg: DecodeConfig,
                  image_rows: Optional[Sequence[int]] = None) -> None:
    """Raises :class:`PolestarError` for empty prompts, out-of-vocabulary ids or too long sequences.
    ``image_rows``: per prompt, how many image rows its local ids ``E + j`` may name
    (:mod:`polestar_jax.engine.images`; default none)."""
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
        top = mcfg.embedding_size + (image_rows[r] if image_rows else 0)
        if a.min() < 0 or a.max() >= top:
            raise PolestarError(f"prompt {r} has token ids outside [0, {top})")


def prompt_slot(lengths: Sequence[int], multiple: int = PAD_MULTIPLE) -> int:
    """The prompt slot of prompts of these lengths: the longest rounded up to ``multiple`` (prompts are
    left-padded to it, so prompts of one length bucket share one executable)."""
    longest = max(int(n) for n in lengths)
    return -(-longest // multiple) * multiple


def batch_bucket(n: int, limit: Optional[int] = None) -> int:
    """The batch a fixed batch of ``n`` prompts compiles for: the smallest power of two that holds them,
    at most ``limit`` (a job's batch size) when that holds them, so that jobs of nearby sizes share one
    executable (1, 2, 4, 8, 16, 32, 64, ..., and the batch size itself)."""
    b = 1 << max(0, int(n) - 1).bit_length()
    return min(b, int(limit)) if limit is not None and limit >= n else b


#: XLA options of the programs compiled for a platform. GPU: GEMMs through cuBLAS, whose dynamic-slice
#: fusion reads a layer's weights in place inside the layer scan (Triton's GEMMs made XLA copy each layer's
#: weight slices first: 2.4x the bytes a step needs, ``bench/gpu_proxy.py``), and no merging of the GEMMs
#: that share an operand (a merged GEMM concatenates the weights anew on every call).
COMPILER_OPTIONS = {"gpu": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}}


def compiler_options(platform: Optional[str]) -> Optional[dict]:
    """The XLA options the engine compiles with for ``platform`` (None: XLA's defaults)."""
    return COMPILER_OPTIONS.get("gpu" if platform in GPU_PLATFORMS else platform)


def platform_of(key) -> Optional[str]:
    """The platform of the devices a program key's shardings (:func:`_signature`) name (None: no sharding
    given; the default backend's programs)."""
    if isinstance(key, tuple):
        return next((p for p in map(platform_of, key) if p is not None), None)
    devices = getattr(key, "device_set", None)
    return next(iter(devices)).platform if devices else None


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple((tuple(a.shape), str(a.dtype), getattr(a, "sharding", None)) for a in leaves))


def _several_devices(key) -> bool:
    """Whether a program key (nested tuples ending in shardings: :func:`_signature`) names an argument laid
    out over several devices."""
    if isinstance(key, tuple):
        return any(_several_devices(k) for k in key)
    devices = getattr(key, "device_set", None)
    return devices is not None and len(devices) > 1


def _mesh_of(tree):
    for leaf in jax.tree.leaves(tree):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None and getattr(mesh, "size", 1) > 1:
            return mesh
    return None


def _write_row(state: DecodeState, row: DecodeState, slot) -> DecodeState:
    """``state`` with its batch row ``slot`` replaced by ``row`` (a state of one row). Fields declared
    ``select=False`` (Polestar's store, possibly in host memory) are left alone: a row's first block start
    rewrites them before anything reads them."""

    def put(big, small, ax):
        if not ax.select:
            return big
        return lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis=ax.batch)

    return jax.tree.map(put, state, row, axes_of(state))


def _insert(state: DecodeState, fields: PromptFields, slot, layout: StateLayout) -> DecodeState:
    return _write_row(state, build_state(fields, layout), slot)


#: every Engine of this process still referenced (:meth:`Engine.clear_all`)
_LIVE: "weakref.WeakSet[Engine]" = weakref.WeakSet()


class Engine:
    """A loaded model, ready to decode: see the module docstring.

    params, config:   the parameter pytree and its :class:`ModelConfig`
    tokenizer:        its tokenizer (optional): adds the chat end-of-turn ids to the stop tokens
    mesh:             a ``jax.sharding.Mesh`` (axes data, model): parameters and states are sharded over it
    max_executables:  compiled programs kept (least recently used dropped first)
    log:              called with one line before a program compiles and with its seconds after (the CLIs
                      print it on stderr); None: silent
    """

    def __init__(self, params, config: ModelConfig, tokenizer=None, mesh=None, max_executables: int = 32,
                 log: Optional[Callable[[str], None]] = None):
        if max_executables < 1:
            raise PolestarError(f"max_executables must be >= 1, got {max_executables}")
        self.config = config
        self.tokenizer = tokenizer
        self.mesh = mesh
        self.log = log
        self.max_executables = int(max_executables)
        if mesh is not None:
            from polestar_jax import sharding

            params = sharding.shard(params, sharding.param_shardings(params, mesh, config))  # whole heads (GQA)
        self.params = params
        self.dtype = quant.float_dtype(params)  # (int8 weights: their scales' float dtype)
        eot = frozenset() if tokenizer is None else frozenset(getattr(tokenizer, "end_of_turn_ids", ()))
        #: ids that end a response (EOS, pad, the chat end-of-turn token)
        self.stop_ids = frozenset({config.eos_token_id, config.pad_token_id}) | eot
        #: ids TPF does not count (EOS, pad), as bench.run and the paper
        self.eos_ids = frozenset({config.eos_token_id, config.pad_token_id})
        self._programs: collections.OrderedDict = collections.OrderedDict()
        self._builders: dict = {}  # the sharded state builders (with a mesh), one per layout and shape
        self.compiles = 0  # programs compiled by this engine so far (loads from the caches and the store included)
        #: the latest compiles (:class:`CompileRecord`, oldest first; bounded)
        self.compile_records: collections.deque = collections.deque(maxlen=256)
        _LIVE.add(self)

    # ----------------------------------------------------------------------------------- executables
    def __repr__(self) -> str:
        return (f"Engine(layers={self.config.n_layers}, d_model={self.config.d_model}, "
                f"executables={self.executable_count})")

    @property
    def executable_count(self) -> int:
        """Compiled programs this engine holds now."""
        return len(self._programs)

    def clear(self) -> None:
        """Drops every compiled program (and sharded state builder) this engine holds."""
        self._programs.clear()
        self._builders.clear()

    @staticmethod
    def clear_all() -> int:
        """:meth:`clear` on every engine of this process that is still referenced (a process holding many
        programs: docs/usage.md, the CPU's mapping limit); returns how many engines held programs."""
        held = [e for e in list(_LIVE) if e._programs or e._builders]
        for e in held:
            e.clear()
        return len(held)

    def _program(self, key, build: Callable[[], Any], what: str):
        """The program cached under ``key`` (on first use: loaded from the executable store without tracing
        (:mod:`polestar_jax.engine.executables`), or ``build()`` traces and lowers it, then XLA compiles it or the
        persistent cache loads it; the store keeps what XLA compiled); returns (program, seconds)."""
        if key in self._programs:
            self._programs.move_to_end(key)
            return self._programs[key], 0.0
        if self.log is not None:
            self.log(f"compiling {what} ...")
        t0 = time.perf_counter()
        folder = executables.store_folder() if self.mesh is None and not _several_devices(key) else None
        name = executables.digest(key) if folder else None
        prog = executables.load(folder, name) if name else None
        if prog is not None:  # stored by an earlier process: no tracing at all
            rec = CompileRecord(what, 0.0, time.perf_counter() - t0, True, from_store=True)
        else:
            with program_target(self.platform):  # (traced for this engine's devices, wherever it runs)
                lowered = build()
            t1 = time.perf_counter()
            hits = cache_hits()
            prog = lowered.compile(compiler_options(platform_of(key)))
            rec = CompileRecord(what, t1 - t0, time.perf_counter() - t1, cache_hits() > hits)
            # (asked whatever the store's state: it remembers what JAX's persistent cache loaded)
            if executables.freshly_compiled(prog, rec.compile_seconds, rec.cache_hit) and name:
                executables.save(folder, name, prog)
        self.compile_records.append(rec)
        if self.log is not None:
            self.log(rec.line())
        self._programs[key] = prog
        self.compiles += 1
        while len(self._programs) > self.max_executables:
            self._programs.popitem(last=False)
        return prog, rec.seconds

    @property
    def platform(self) -> str:
        """The platform of the devices the parameters live on (``"cpu"``, ``"gpu"``, ``"tpu"``)."""
        leaf = jax.tree.leaves(self.params)[0]
        devices = getattr(getattr(leaf, "sharding", None), "device_set", None)
        return next(iter(devices)).platform if devices else jax.default_backend()

    def spec(self, dcfg: DecodeConfig) -> EngineSpec:
        """The block program's structure for ``dcfg`` (with this model's stop tokens for early exit)."""
        return EngineSpec.from_config(self.config, dcfg, stop_ids=tuple(self.stop_ids), platform=self.platform)

    def block_program(self, params, state: DecodeState, knobs: Knobs, spec: EngineSpec, replay=None):
        """The compiled block program for these shapes, compiling it on first use. Returns ``(fn,
        compile_seconds)``; ``fn(params, state, knobs, replay) -> (state, stats)`` advances every live row
        of ``state`` by one block (the state is donated)."""
        key = ("block", spec, _signature(params), _signature(state), _signature(knobs), _signature(replay))
        b, slot = state.x.shape[0], state.x.shape[1] - spec.gen_length

        def build():
            mesh = _mesh_of(state)
            kw = {}
            if mesh is not None:  # keep the state's sharding across blocks: outputs take the input layout
                from jax.sharding import NamedSharding, PartitionSpec

                out = jax.eval_shape(lambda p, s, k, r: decode_block(p, s, k, r, spec), params, state, knobs, replay)
                rep = NamedSharding(mesh, PartitionSpec())
                kw["out_shardings"] = (jax.tree.map(lambda a: a.sharding, state), jax.tree.map(lambda _: rep, out[1]))
            jitted = jax.jit(decode_block, static_argnames=("spec",), donate_argnames=("state",), **kw)
            if mesh is None or platform_of(key) == "cpu":
                return jitted.lower(params, state, knobs, replay, spec)
            with jax.set_mesh(mesh):  # (the kernels run per shard on it: kernels.backend)
                return jitted.lower(params, state, knobs, replay, spec)

        return self._program(key, build, f"the {spec.decoder} block program for batch {b}, prompt slot {slot}, "
                                         f"gen length {spec.gen_length}")

    def insert_program(self, state: DecodeState, fields: PromptFields, layout: StateLayout):
        key = ("insert", layout, _signature(state), _signature(fields))

        def build():
            kw = {}
            mesh = _mesh_of(state)
            if mesh is not None:
                kw["out_shardings"] = jax.tree.map(lambda a: a.sharding, state)
            return jax.jit(_insert, static_argnames=("layout",), donate_argnames=("state",), **kw).lower(
                state, fields, jnp.int32(0), layout)

        return self._program(key, build, f"the row insertion for batch {state.x.shape[0]}")

    def precompile(self, dcfg: DecodeConfig, shapes: Sequence[tuple[int, int]], running: bool = False,
                   sampling: bool = False, compact_rows: Optional[int] = None) -> list[CompileRecord]:
        """Compiles ``dcfg``'s programs for each ``(batch, prompt_slot)`` of ``shapes`` now, so that the jobs
        of those shapes start decoding at once (with the persistent cache on, later processes load them).
        ``running``: the programs of a :class:`RunningBatch` of that many slots (a continuous job, the
        server; ``sampling`` its sampling variant, ``compact_rows`` its step chunk) instead of a fixed batch's (:meth:`run`; :meth:`generate`
        when the prompts fit, its batch bucketed with :func:`batch_bucket`). Returns the records of the
        programs compiled (none for a shape already held)."""
        n0 = self.compiles
        for b, slot in shapes:
            b, slot = int(b), int(slot)
            if b < 1 or slot < 1:
                raise PolestarError(f"a shape to compile needs a batch and a prompt slot >= 1, got {b}x{slot}")
            if running:
                RunningBatch(self, dcfg, b, slot, sampling=sampling, compact_rows=compact_rows)
            else:  # a state of this shape (its values do not matter: the program is keyed by shapes)
                prompts, params = self.with_images(self.params, [[self.config.pad_token_id]] * b, None, slot)
                state = self.initial_state(prompts, dcfg, slot, 0, list(range(b)), None)
                self.block_program(params, state, self.knobs(dcfg), self.spec(dcfg))
        new = self.compiles - n0
        return list(self.compile_records)[-new:] if new else []

    # ----------------------------------------------------------------------------------- bucketing
    def prompt_slot(self, lengths: Sequence[int], multiple: int = PAD_MULTIPLE) -> int:
        """The prompt slot of prompts of these lengths (:func:`prompt_slot`)."""
        return prompt_slot(lengths, multiple)

    def check(self, prompts: Sequence[Sequence[int]], dcfg: DecodeConfig,
              image_rows: Optional[Sequence[int]] = None) -> None:
        """:func:`check_prompts` for this model."""
        check_prompts(prompts, self.config, dcfg, image_rows)

    def with_images(self, params, prompts: Sequence[Sequence[int]], images, slot: int):
        """``(prompts, params)`` of a fixed batch at prompt slot ``slot``: for a model that takes images
        (LLaDA-V) the prompts' image ids placed in their rows' regions of an image-row table, which
        ``params`` then carries (:func:`~polestar_jax.engine.images.batch_table`; every fixed batch of the
        model has one, so text-only and image batches share their programs; on a mesh :meth:`run` places
        the table on every device, as the embedding), unless ``params`` holds one already; else as given."""
        if not image_table.has_vision(self.config) or "image_rows" in params:
            return prompts, params
        return image_table.batch_table(params, prompts, [None] * len(prompts) if images is None else images, slot)

    def knobs(self, dcfg: DecodeConfig, batch: Optional[int] = None) -> Knobs:
        """``dcfg``'s traced scalars, shared (``batch`` None) or one per row ([batch])."""
        k = Knobs.from_config(dcfg)
        return k if batch is None else jax.tree.map(lambda a: jnp.full((batch,), a, jnp.float32), k)

    def initial_state(self, prompts, dcfg, prompt_slot, seed, rows, gen_lengths, abstract: bool = False) -> DecodeState:
        """The decode state of ``prompts`` on this engine's mesh, dtype and builders (:func:`init_decode_state`;
        ``abstract``: shape structs with their shardings, for ahead-of-time compiles)."""
        with program_target(self.platform):  # (built for this engine's devices, wherever it runs)
            return init_decode_state(self.config, dcfg, prompts, prompt_slot, seed=seed, rows=rows, dtype=self.dtype,
                                     mesh=self.mesh, gen_lengths=gen_lengths, builders=self._builders,
                                     abstract=abstract)

    # ----------------------------------------------------------------------------------- fixed batches
    def run(self, prompts: Sequence[Sequence[int]], dcfg: DecodeConfig, seed: int = 0,
            rows: Optional[Sequence[int]] = None, prompt_slot: Optional[int] = None, replay=None,
            gen_lengths: Optional[Sequence[int]] = None, params=None, images=None) -> GenerateResult:
        """Decodes one fixed batch: every row starts at block 0; all blocks are dispatched asynchronously (no
        host sync inside the job) and the results are read once at the end, per-step statistics included.

        prompts:     b token-id lists; left-padded to ``prompt_slot`` (default :meth:`prompt_slot`)
        seed, rows:  prompt r's randomness comes from ``(seed, rows[r])`` only (default ``rows = 0..b-1``)
        replay:      (Polestar) a :class:`polestar_jax.decode.polestar.draws.Replay` of decisions from a PyTorch trace
        gen_lengths: per row, a multiple of the block length up to ``dcfg.gen_length`` (default: all)
        params:      other parameters of the same shapes (default: the engine's)
        images:      per prompt, its image rows [R, D] (or None) named by its local ids
                     (:mod:`polestar_jax.engine.images`; LLaDA-V)
        """
        self.check(prompts, dcfg, image_table.image_counts(prompts, images))
        slot = prompt_slot or self.prompt_slot([len(p) for p in prompts])
        if slot < max(len(p) for p in prompts):
            raise PolestarError(f"prompt_slot {slot} is shorter than the longest prompt")
        rows = list(range(len(prompts))) if rows is None else [int(r) for r in rows]
        if len(rows) != len(prompts):
            raise PolestarError(f"rows has {len(rows)} entries for {len(prompts)} prompts")
        if not isinstance(seed, (int, np.integer)):
            raise PolestarError(f"seed must be an integer, got {seed!r}")
        gens = self.gen_lengths(gen_lengths, len(prompts), dcfg)
        prompts, params = self.with_images(self.params if params is None else params, prompts, images, slot)
        if self.mesh is not None and params is not self.params:
            from polestar_jax import sharding

            params = sharding.shard(params, sharding.param_shardings(params, self.mesh, self.config))
        if self.mesh is not None and replay is not None:
            from polestar_jax import sharding

            replay = sharding.shard(replay, sharding.state_shardings(replay, self.mesh))
        spec, knobs = self.spec(dcfg), self.knobs(dcfg)
        state = self.initial_state(prompts, dcfg, slot, seed, rows, gens)
        fn, compile_seconds = self.block_program(params, state, knobs, spec, replay)
        t0 = time.perf_counter()
        steps = []
        for _ in range(max(gens) // dcfg.block_length):  # dispatched asynchronously: no host sync in the loop
            state, st = fn(params, state, knobs, replay)
            steps.append(st)
        dispatch_seconds = time.perf_counter() - t0
        stats = own_stats(state, dcfg.decoder)  # only what the result reports (not a policy's store)
        x, cstep, nfe, bnfe, blocks, pol, steps = to_host(
            (state.x, state.commit_step, state.nfe, state.block_nfe, state.block, stats, steps))
        seconds = time.perf_counter() - t0
        pstats = None if pol is None else {k: np.asarray(v) for k, v in pol.items()}
        return GenerateResult(tokens=np.asarray(x[:, slot:]), commit_step=np.asarray(cstep[:, slot:]),
                              nfe=np.asarray(nfe), block_nfe=np.asarray(bnfe), seconds=seconds,
                              compile_seconds=compile_seconds, dispatch_seconds=dispatch_seconds, polestar=pstats,
                              steps=steps if pol is not None else None, blocks=np.asarray(blocks))

    def gen_lengths(self, gen_lengths, n: int, dcfg: DecodeConfig) -> list[int]:
        """Each of ``n`` rows' generation length (``gen_lengths``; None: ``dcfg``'s); a one-line error unless
        each is a positive multiple of the block length up to ``dcfg.gen_length``."""
        if gen_lengths is None:
            return [dcfg.gen_length] * n
        gens = [int(g) for g in gen_lengths]
        if len(gens) != n:
            raise PolestarError(f"gen_lengths has {len(gens)} entries for {n} prompts")
        for g in gens:
            if g <= 0 or g > dcfg.gen_length or g % dcfg.block_length:
                raise PolestarError(f"a row's gen length must be a positive multiple of the block length "
                                    f"{dcfg.block_length} up to {dcfg.gen_length}, got {g}")
        return gens

    # ----------------------------------------------------------------------------------- continuous jobs
    def batch(self, dcfg: DecodeConfig, size: int, prompt_slot: int) -> "RunningBatch":
        """An empty :class:`RunningBatch` of ``size`` slots at this prompt slot (its programs compiled)."""
        return RunningBatch(self, dcfg, size, prompt_slot)

    def generate(self, prompts: Sequence[Sequence[int]], dcfg: DecodeConfig, seed: int = 0,
                 rows: Optional[Sequence[int]] = None, batch_size: Optional[int] = None,
                 prompt_slot: Optional[int] = None, gen_lengths: Optional[Sequence[int]] = None,
                 on_row: Optional[Callable[[RowOutput], None]] = None, images=None) -> "JobResult":
        """Decodes any number of prompts as one job. When they all fit (``batch_size`` None or >= their number):
        one fixed batch in lockstep (:meth:`run`; rows stop early but start together). Else a continuous job:
        a :class:`RunningBatch` of ``batch_size`` slots that stays full: a finished row's slot takes the next
        prompt at the next block boundary. Prompt i's randomness comes from ``(seed, rows[i])`` (default ``rows[i] = i``). ``on_row`` is called
        with each :class:`RowOutput` as it finishes. ``images``: per prompt, its image rows or None (see
        :meth:`run`). Returns a :class:`JobResult` (rows in prompt order)."""
        n = len(prompts)
        self.check(prompts, dcfg, image_table.image_counts(prompts, images))
        rows = list(range(n)) if rows is None else [int(r) for r in rows]
        if len(rows) != n:
            raise PolestarError(f"rows has {len(rows)} entries for {n} prompts")
        if batch_size is not None and batch_size < 1:
            raise PolestarError(f"batch size must be >= 1, got {batch_size}")
        gens = self.gen_lengths(gen_lengths, n, dcfg)
        slot = prompt_slot or self.prompt_slot([len(p) for p in prompts])
        if slot < max(len(p) for p in prompts):
            raise PolestarError(f"prompt_slot {slot} is shorter than the longest prompt")
        if batch_size is None or n <= batch_size:  # every prompt fits: one fixed batch in lockstep (early exit)
            t_start = time.perf_counter()
            # the batch is bucketed (batch_bucket): the extra rows are copies of row 0 (same steps, dropped)
            b = batch_bucket(n, batch_size)
            pad = b - n
            res = self.run(list(prompts) + [prompts[0]] * pad, dcfg, seed=seed, rows=rows + [rows[0]] * pad,
                           prompt_slot=slot, gen_lengths=gens + [gens[0]] * pad,
                           images=None if images is None else list(images) + [images[0]] * pad)
            out = [res.row(r, rows[r]) for r in range(n)]
            for r in out:
                if on_row is not None:
                    on_row(r)
            return JobResult(rows=out, decode=dcfg, seconds=res.seconds, compile_seconds=res.compile_seconds,
                             batch_size=b, prompt_slot=slot, block_calls=max(gens) // dcfg.block_length,
                             wall_seconds=time.perf_counter() - t_start)
        size = batch_size
        t_start = time.perf_counter()
        batch = self.batch(dcfg, size, slot)
        compile_seconds = batch.compile_seconds
        out: list[Optional[RowOutput]] = [None] * n
        queue = collections.deque(range(n))
        t0 = time.perf_counter()
        blocks_run = 0
        while queue or batch.occupied:
            while queue and batch.free_slots:
                i = queue.popleft()
                batch.insert(prompts[i], seed=seed, row=rows[i], tag=i, gen_length=gens[i],
                             images=None if images is None else images[i])
            if not queue:  # nobody waits: run the remaining blocks without syncing after each
                for _ in range(batch.max_blocks_left()):
                    batch.step()
                    blocks_run += 1
            else:
                batch.step()
                blocks_run += 1
            for r in batch.finished():
                out[r.index] = r
                if on_row is not None:
                    on_row(r)
        seconds = time.perf_counter() - t0
        for r in out:
            r.index = rows[r.index] if r is not None else 0  # type: ignore[union-attr]
        return JobResult(rows=out, decode=dcfg, seconds=seconds, compile_seconds=compile_seconds,  # type: ignore[arg-type]
                         batch_size=size, prompt_slot=slot, block_calls=blocks_run,
                         wall_seconds=time.perf_counter() - t_start)

    # ----------------------------------------------------------------------------------- accounting
    def response_ids(self, tokens, max_tokens: Optional[int] = None) -> tuple[list, str]:
        """The response in generated ids ``tokens`` [n]: up to the first stop token, at most ``max_tokens``
        ids; and its finish reason ("stop": a stop token ended it, else "length")."""
        resp, reason = [], "length"
        for t in tokens:
            if int(t) in self.stop_ids:
                reason = "stop"
                break
            resp.append(int(t))
        if max_tokens is not None and len(resp) > max_tokens:
            resp, reason = resp[:max_tokens], "length"
        return resp, reason

    def completion(self, row: RowOutput, max_tokens: Optional[int] = None) -> Completion:
        """The response of ``row`` (:meth:`response_ids`), its non-EOS count over the decoded blocks, NFE, TPF
        and Polestar statistics."""
        gen = [int(t) for t in row.tokens]
        resp, reason = self.response_ids(gen, max_tokens)
        non_eos = sum(1 for t in gen if t not in self.eos_ids)
        return Completion(response_ids=resp, non_eos_tokens=non_eos, nfe=row.nfe,
                          tpf=non_eos / row.nfe if row.nfe else 0.0, stats=polestar_stats(row.polestar),
                          finish_reason=reason)


@dataclasses.dataclass
class _Occupant:
    tag: Any
    n_blocks: int
    inserted: float
    blocks_dispatched: int = 0


def running_spec(engine: Engine, dcfg: DecodeConfig, size: int, sampling: bool = False,
                 compact_rows: Optional[int] = None) -> EngineSpec:
    """The block program's structure of a :class:`RunningBatch` of ``size`` slots on ``engine`` (per-row
    blocks; its step chunk, :func:`compact_width` unless ``compact_rows`` sets it; ``sampling``: the sampling
    variant). Ahead-of-time compiles (``bench.tpu_proxy``, ``bench.gpu_proxy``) build the same spec."""
    spec = dataclasses.replace(engine.spec(dcfg), per_row=True)  # rows join and leave at any block boundary
    sharded = engine.mesh is not None and engine.mesh.shape.get("data", 1) > 1
    with program_target(engine.platform):  # (whether the store sits in host memory: the engine's devices)
        auto = compact_width(size, spec, sharded, engine.platform)
        if compact_rows is not None and compact_rows != auto:
            if compact_rows < 0:
                raise PolestarError(f"compact_rows must be >= 0, got {compact_rows}")
            if compact_rows and (sharded or compact_width(1 << 30, spec) == 0):
                raise PolestarError("compacted steps need an unsharded batch and Polestar's store in device memory")
            auto = int(compact_rows) if compact_rows < size else 0
    spec = dataclasses.replace(spec, compact_rows=auto)
    if sampling:  # the sampling variant: per-row temperatures, 0 included (x + 0 * noise = x: greedy tokens)
        spec = dataclasses.replace(spec, stochastic=True)
    return spec


class RunningBatch:
    """A batch of ``size`` decode slots at one prompt slot and one decode structure (``dcfg``), whose rows
    each sit at their own block. :meth:`insert` puts a prompt into a free slot (between calls: at a block
    boundary), :meth:`step` advances every live row by one block (asynchronously), :meth:`finished`
    returns the rows that are done (reading the small per-row progress arrays from the device) and frees
    their slots. Knobs (threshold, factor, temperature) may differ per row; nothing recompiles.

    ``compact_rows``: each step of a block runs on the rows still active only, in chunks of this many rows
    (:func:`polestar_jax.decode.block.compact_width`; None: automatic, an eighth of a batch of 16 rows or more; 0:
    off). Tokens do not depend on it; a block whose rows need different numbers of forwards costs less."""

    def __init__(self, engine: Engine, dcfg: DecodeConfig, size: int, prompt_slot: int, sampling: bool = False,
                 compact_rows: Optional[int] = None):
        if size < 1:
            raise PolestarError(f"batch size must be >= 1, got {size}")
        self.engine, self.dcfg, self.size, self.slot = engine, dcfg, int(size), int(prompt_slot)
        self.spec = running_spec(engine, dcfg, self.size, sampling, compact_rows)
        self.layout = state_layout(engine.config, dcfg, engine.dtype)
        empty = [[engine.config.pad_token_id]] * self.size
        self.state = engine.initial_state(empty, dcfg, self.slot, 0, list(range(self.size)), None)
        self.state = self.state.replace(n_blocks=jnp.zeros_like(self.state.n_blocks))  # every slot free
        #: LLaDA-V: each slot's image rows (:class:`~polestar_jax.engine.images.SlotTable`); else None
        self.images = (image_table.SlotTable(engine.params, self.size, self.slot, engine.mesh)
                       if image_table.has_vision(engine.config) else None)
        base = Knobs.from_config(dcfg)
        self._base_knobs = {k: float(getattr(base, k)) for k in Knobs._fields}  # (read once: host floats)
        self._knobs = {k: np.full((self.size,), v, np.float32) for k, v in self._base_knobs.items()}
        self._knobs_dev = None
        self.fn, c1 = engine.block_program(self.params, self.state, self.knobs, self.spec)
        self.insert_fn, c2 = engine.insert_program(self.state, self._fields([1], 0, 0, dcfg.gen_length), self.layout)
        self.compile_seconds = c1 + c2
        self.slots: list[Optional[_Occupant]] = [None] * self.size
        self._freed: set[int] = set()  # slots freed on the host whose rows the device still counts as live
        decoder = dcfg.decoder
        self._pack = jax.jit(lambda s: snapshot.pack(s, self.slot, own_stats(s, decoder)))
        self._cols = snapshot.layout(self.state, self.slot, own_stats(self.state, decoder))

    @property
    def params(self):
        """The parameters each block call reads: the engine's, with the slots' image rows for LLaDA-V."""
        return self.engine.params if self.images is None else self.images.params(self.engine.params)

    @property
    def knobs(self) -> Knobs:
        if self._knobs_dev is None:
            self._knobs_dev = Knobs(**{k: jnp.asarray(v) for k, v in self._knobs.items()})
        return self._knobs_dev

    @property
    def free_slots(self) -> list[int]:
        return [i for i, o in enumerate(self.slots) if o is None]

    @property
    def occupied(self) -> int:
        return sum(o is not None for o in self.slots)

    def _fields(self, prompt, seed: int, row: int, gen_length: int) -> PromptFields:
        return prompt_fields([prompt], self.engine.config, self.dcfg.gen_length, self.slot, [row_key_data(seed, row)],
                             self.dcfg.block_length, [gen_length])

    def insert(self, prompt: Sequence[int], seed: int = 0, row: int = 0, tag: Any = None,
               gen_length: Optional[int] = None, threshold: Optional[float] = None,
               temperature: Optional[float] = None, factor: Optional[float] = None, slot: Optional[int] = None,
               checked: bool = False, images=None) -> int:
        """Puts ``prompt`` into a free slot (``slot``, or the first free one) and returns the slot. Its
        randomness comes from ``(seed, row)``; ``gen_length`` (a multiple of the block length up to the
        batch's) defaults to the batch's; ``threshold`` / ``temperature`` / ``factor`` override the batch's
        knobs for this row (a temperature needs a batch whose decode config samples: ``temperature > 0``).
        ``checked``: the caller has passed the prompt and gen length through :meth:`check` already.
        ``images``: the prompt's image rows [R, D] named by its local ids (:mod:`polestar_jax.engine.images`)."""
        free = self.free_slots
        if not free:
            raise PolestarError("no free slot in the running batch")
        slot = free[0] if slot is None else int(slot)
        if self.slots[slot] is not None:
            raise PolestarError(f"slot {slot} is taken")
        n_rows = 0 if images is None else int(images.shape[0])
        if n_rows and self.images is None:
            raise PolestarError("this model takes no images")
        gen = self.check(prompt, gen_length, n_rows) if not checked else (
            self.dcfg.gen_length if gen_length is None else int(gen_length))
        if temperature is not None and temperature > 0 and not self.spec.stochastic:
            raise PolestarError("this batch decodes greedily (temperature 0); sampling needs a batch with a "
                                "temperature > 0")
        for name, v in (("threshold", threshold), ("temperature", temperature), ("factor", factor)):
            self._knobs[name][slot] = self._base_knobs[name] if v is None else float(v)
        self._knobs_dev = None
        if self.images is not None:
            prompt = self.images.insert(prompt, images, slot)
        # (a NumPy scalar: jnp.int32 would run an eager conversion per insert)
        self.state = self.insert_fn(self.state, self._fields(prompt, seed, row, gen), np.int32(slot))
        self._freed.discard(slot)  # (the insertion rewrote the whole row)
        self.slots[slot] = _Occupant(tag=tag, n_blocks=gen // self.dcfg.block_length, inserted=time.perf_counter())
        return slot

    def check(self, prompt: Sequence[int], gen_length: Optional[int] = None, image_rows: int = 0) -> int:
        """The row's gen length (``gen_length``, default the batch's), or a one-line :class:`PolestarError` for
        a prompt this batch cannot take: longer than the prompt slot, empty or with ids outside the vocabulary,
        or a gen length that is not a positive multiple of the block length up to the batch's. ``image_rows``:
        the image rows its local ids may name."""
        if len(prompt) > self.slot:
            raise PolestarError(f"a prompt of {len(prompt)} tokens does not fit the prompt slot {self.slot}")
        self.engine.check([prompt], self.dcfg, [image_rows])
        return self.engine.gen_lengths(None if gen_length is None else [gen_length], 1, self.dcfg)[0]

    def step(self) -> snapshot.PendingBlock:
        """Advances every live row by one block (dispatched asynchronously) and returns the block's result on
        its way to the host (:class:`~polestar_jax.engine.snapshot.PendingBlock`: read it while the next block
        runs; :meth:`rows_of` turns its finished rows into outputs)."""
        self._apply_frees()
        self.state, _ = self.fn(self.params, self.state, self.knobs, None)
        for o in self.slots:
            if o is not None:
                o.blocks_dispatched += 1
        return snapshot.PendingBlock(self._pack(self.state), self._cols, [None if o is None else o.tag
                                                                         for o in self.slots])

    def holds(self, result: snapshot.BlockResult, slot: int) -> bool:
        """Whether ``slot`` still holds the row ``result`` was taken of (not freed, not taken by another since)."""
        o = self.slots[slot]
        return o is not None and result.tags[slot] is not None and o.tag == result.tags[slot]

    def rows_of(self, result: snapshot.BlockResult, slots: Sequence[int]) -> list[RowOutput]:
        """The rows of ``slots`` as ``result`` has them (their blocks decoded by then), and their slots freed; a
        slot whose row left or changed since ``result`` was dispatched is skipped (see :meth:`holds`)."""
        out, now, B = [], time.perf_counter(), self.dcfg.block_length
        for i in slots:
            if not self.holds(result, i):
                continue
            n = int(result.blocks[i])
            out.append(RowOutput(index=self.slots[i].tag, tokens=result.tokens[i, : n * B].copy(),
                                 commit_step=result.commit_step[i, : n * B].copy(), nfe=int(result.nfe[i]),
                                 block_nfe=np.array(result.block_nfe[i, :n]),
                                 polestar=None if result.stats is None else
                                 {k: np.array(v[i]) for k, v in result.stats.items()},
                                 seconds=now - self.slots[i].inserted))
            self.cancel(i)
        return out

    def max_blocks_left(self) -> int:
        """The most blocks a row still in the batch may need (without early exit)."""
        return max([o.n_blocks - o.blocks_dispatched for o in self.slots if o is not None] + [0])

    def progress(self) -> tuple[np.ndarray, np.ndarray]:
        """(blocks decoded [size], done [size]) read from the device (a host sync)."""
        blk, n, stop = to_host((self.state.block, self.state.n_blocks, self.state.stop))
        return np.asarray(blk), (np.asarray(blk) >= np.asarray(n)) | np.asarray(stop)

    def tokens(self, slots: Sequence[int]) -> np.ndarray:
        """[len(slots), G] the generation region of these slots (a host sync); undecoded blocks hold masks."""
        # (the whole region, indexed here: an index array on the device would compile a gather per count)
        return np.asarray(to_host(self.state.x))[list(slots), self.slot:]

    def finished(self, progress: Optional[tuple] = None) -> list[RowOutput]:
        """The rows that are done (their last block, or early exit), read from the device; their slots are free
        again. A row's ``index`` is its insertion ``tag``. ``progress``: :meth:`progress`'s result when the
        caller has just read it."""
        blk, done = self.progress() if progress is None else progress
        return self.take([i for i, o in enumerate(self.slots) if o is not None and done[i]], blk)

    def take(self, slots: Sequence[int], blocks: Optional[np.ndarray] = None) -> list[RowOutput]:
        """The rows of ``slots`` as they are now (their decoded blocks), and their slots freed (a row still
        decoding leaves at this block boundary)."""
        out: list[RowOutput] = []
        idx = [i for i in slots if self.slots[i] is not None]
        if not idx:
            return out
        blk = self.progress()[0] if blocks is None else blocks
        s = self.state
        # whole (small) arrays to the host, rows picked there: an index array on the device would compile a
        # gather for every new number of finished rows
        pol = own_stats(s, self.dcfg.decoder)
        x, cstep, nfe, bnfe, pol = to_host((s.x, s.commit_step, s.nfe, s.block_nfe, pol))
        x, cstep = np.asarray(x)[:, self.slot:], np.asarray(cstep)[:, self.slot:]
        now = time.perf_counter()
        B = self.dcfg.block_length
        for i in idx:  # (copies: a row keeps nothing of the batch's arrays alive)
            o = self.slots[i]
            n = int(blk[i])
            out.append(RowOutput(index=o.tag, tokens=x[i, : n * B].copy(), commit_step=cstep[i, : n * B].copy(),
                                 nfe=int(nfe[i]), block_nfe=np.array(bnfe[i, :n]),
                                 polestar=None if pol is None else {k: np.array(v[i]) for k, v in pol.items()},
                                 seconds=now - o.inserted))
            self.cancel(i)
        return out

    def cancel(self, slot: int) -> None:
        """Frees ``slot`` now (its row leaves at this block boundary; its results are dropped). The device
        state learns it with the next :meth:`step`, once for every slot freed since (one small update, not
        one per row)."""
        if self.slots[slot] is None:
            return
        self.slots[slot] = None
        self._freed.add(slot)

    def _apply_frees(self) -> None:
        """The slots freed since the last step get no blocks (their rows are no longer live)."""
        if self._freed:
            mask = np.zeros((self.size,), bool)
            mask[list(self._freed)] = True
            self.state = self.state.replace(n_blocks=jnp.where(mask, 0, self.state.n_blocks))
            self._freed.clear()
