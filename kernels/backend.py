"""Backend selection for the Polestar kernels.

Every kernel wrapper in this package takes ``backend=`` (one of :data:`KINDS`) and dispatches through
:func:`dispatch`:

* ``"reference"``: the plain-jnp ``*_reference`` function (XLA fuses it; the numerics ground truth).
* ``"interpret"``: the Pallas kernel run by the Pallas interpreter (any platform; slow, for tests).
* ``"pallas"``: the compiled Pallas kernel for the platform the function is *lowered* for: Triton on
  ``cuda``, Mosaic on ``tpu``; on a platform without a lowering (cpu, or a kernel marked unsupported in
  :data:`SUPPORTED`) the interpreter.
* ``"auto"``: as ``"pallas"`` where :data:`SUPPORTED` lists a lowering for the platform, else the
  reference (so ``auto`` is the reference on cpu).

Where the platform is chosen: by the program's *target*, when it is lowered, not by the process.

* by default (``auto`` / ``pallas``) a kernel call is one ``polestar_kernel`` primitive that carries the
  fallback's jaxpr (the reference for ``auto``, the interpreted kernel for ``pallas``: traced once, as
  before, and what the program's shapes come from) and, for every platform of :data:`SUPPORTED`, the
  function that builds that platform's kernel. Its lowering rules are per platform: a ``jax.jit(f).lower``
  for TPU devices (a real chip, or a topology from ``jax.experimental.topologies`` on a CPU host) lowers
  the Mosaic kernel, a lowering for ``cuda`` the Triton kernel, anything else (cpu, rocm) the fallback's
  jaxpr, inlined: on a CPU a program is the same HLO as the plain reference. Only the target's kernel is
  traced, at lowering; a multi-platform lowering gets each platform's form under XLA's platform switch.
  Under ``jax.vmap`` (a running batch's per-row program) the vmapped axis is folded into every form's
  leading batch axis (the kernels keep their grid; Pallas's own batching of the Mosaic row-DMA kernels
  does not lower). A cuda lowering from a host without a GPU still needs the target GPU named
  (:func:`polestar_jax.compat.lowering_target`, which :func:`polestar_jax.compat.export` enters).
* inside :func:`staged` (:func:`polestar_jax.compat.export` enters it) every platform's kernel is traced
  at once, with :func:`jax.lax.platform_dependent` (what tests/test_compat.py uses to check that every
  branch traces on this CPU); the lowering picks the same way. (Staging out the Triton, Mosaic and
  reference versions of every kernel call cost Polestar's block program 0.6-1.0 s of its 1.9-2.3 s of
  tracing and lowering on the 2-core CPU: bench/README.md, compile time; the default form traces one.)

Staged, every branch is traced on every platform, so each kernel must trace anywhere: in particular
jax >= 0.12 bounds-checks ref slices with a static start at trace time, and the Triton flavours pad the
small operands they read as static whole-block slices to the block sizes (tests/test_compat.py traces
every branch at shapes no block divides).

A wrapper may exclude platforms for one call (``dispatch(..., exclude=)``) where its operands have no
kernel form there (the Mosaic scatter of packed rows: :func:`.refresh.mosaic_rows_exclude`); the call
then falls back as if the table did not list them.

:func:`resolve_backend` answers the same question eagerly for a concrete platform (default: the default
JAX backend), for callers that want to pick an implementation outside of a trace.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax import lax
from jax.interpreters import batching, mlir
from jax.sharding import PartitionSpec

from polestar_jax import compat

KINDS = ("auto", "pallas", "interpret", "reference")

# Platforms (as named by jax.export / lax.platform_dependent) with a compiled Pallas lowering, per kernel.
# A kernel/platform pair that is absent falls back to the reference under "auto" (and to the interpreter
# under "pallas"). tests/test_export.py checks this table both ways: every listed pair lowers, and every
# pair that is absent is served by the reference when exported with "auto". Within a listed pair a call
# may still exclude its platform for its operands (scatter_rows of packed rows on tpu: refresh.py).
# tests/test_tpu_compile.py compiles every tpu entry through Mosaic for v5e and v6e (with libtpu).
SUPPORTED: dict[str, frozenset[str]] = {
    "kl_drift": frozenset({"cuda", "tpu"}),
    "gather_rows": frozenset({"cuda", "tpu"}),
    "scatter_rows": frozenset({"cuda", "tpu"}),
    "centroid_shift": frozenset({"cuda", "tpu"}),
}

# The Pallas flavour (kernel body / layout) used for each platform.
FLAVORS = {"cuda": "triton", "tpu": "mosaic"}

_PLATFORM_ALIASES = {"gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu", "cpu": "cpu"}


def _canonical_platform(platform: Optional[str]) -> str:
    if platform is None:
        platform = jax.default_backend()
        if platform == "gpu" and "rocm" in getattr(jax.devices()[0].client, "platform_version", "").lower():
            return "rocm"
    return _PLATFORM_ALIASES.get(platform.lower(), platform.lower())


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"backend must be one of {KINDS}, got {kind!r}")
    return kind


def resolve_backend(kind: str, platform: Optional[str] = None, kernel: Optional[str] = None) -> str:
    """The implementation ``kind`` selects on ``platform`` (default: ``jax.default_backend()``).

    Returns ``"pallas"`` (compiled kernel), ``"interpret"`` or ``"reference"``. ``auto`` is ``"pallas"``
    on gpu/tpu and ``"reference"`` on cpu; with ``kernel`` given, a platform that kernel cannot lower for
    (see :data:`SUPPORTED`) also resolves to ``"reference"`` (``auto``) or ``"interpret"`` (``pallas``).
    """
    check_kind(kind)
    if kind in ("interpret", "reference"):
        return kind
    plat = _canonical_platform(platform)
    ok = plat in (SUPPORTED[kernel] if kernel is not None else set(FLAVORS))
    if kind == "pallas":
        return "pallas" if ok else "interpret"
    return "pallas" if ok else "reference"


#: Within: every kernel call stages out each platform's implementation and the lowering picks one (for
#: ``jax.export`` to a platform other than this process's default backend); JAX's tracing caches keep staged
#: traces apart from plain ones, so a function traced before, outside, is traced again here.
staged = compat.staged_kernels


def dispatch(name: str, backend: str, args: tuple, *, reference: Callable, pallas: Callable[[str, bool], Callable],
             interpret_flavor: str = "triton", exclude: frozenset = frozenset()):
    """Calls the implementation of kernel ``name`` that ``backend`` selects.

    ``reference(*args)`` is the jnp reference; ``pallas(flavor, interpret)`` returns a function of ``args``
    running the Pallas kernel of that flavour ("triton" | "mosaic"), compiled or interpreted.
    ``interpret_flavor``: which flavour the interpreter runs for ``backend="interpret"`` (and as the
    fallback of ``"pallas"``). ``exclude``: platforms of :data:`SUPPORTED` this call has no kernel on.
    """
    check_kind(backend)
    if backend == "reference":
        return reference(*args)
    if backend == "interpret":
        return pallas(interpret_flavor, True)(*args)
    platforms = [p for p in sorted(SUPPORTED[name] - frozenset(exclude)) if p in FLAVORS]
    default = reference if backend == "auto" else pallas(interpret_flavor, True)
    if compat.kernels_staged():
        branches = {p: pallas(FLAVORS[p], False) for p in platforms}
        return lax.platform_dependent(*args, default=default, **branches)
    return _bind_per_platform(name, args, default, {p: pallas(FLAVORS[p], False) for p in platforms})


# ------------------------------------------------------------------------ the per-platform primitive
_kernel_p = jex_core.Primitive("polestar_kernel")
_kernel_p.multiple_results = True


def _flat(fn: Callable, in_tree, out_trees: list) -> Callable:
    """``fn`` of the pytree ``args`` as a function of their leaves returning the output's leaves (the
    output's treedef is left in ``out_trees[0]``)."""
    def flat_fn(*leaves):
        leaves_out, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, leaves)))
        out_trees[:] = [tree]
        return leaves_out
    return flat_fn


def _bind_per_platform(name: str, args: tuple, default: Callable, kernels: dict[str, Callable]):
    """One ``polestar_kernel`` equation: ``default`` traced now (its jaxpr gives the output shapes and is
    what platforms without a kernel lower; the function is kept for vmap), ``kernels[platform]`` traced
    only when lowered for it."""
    leaves, in_tree = jax.tree.flatten(args)
    out_trees: list = []
    flat_default = _flat(default, in_tree, out_trees)
    closed = jax.make_jaxpr(flat_default)(*leaves)
    flat_kernels = tuple((p, _per_shard(_flat(fn, in_tree, []))) for p, fn in sorted(kernels.items()))
    out = _kernel_p.bind(*leaves, name=name, default=closed, default_fn=flat_default, kernels=flat_kernels)
    return jax.tree.unflatten(out_trees[0], out)


def _abstract_eval(*avals, name, default, default_fn, kernels):
    """The fallback's outputs and effects (the TPU interpreter's callbacks are ordered effects)."""
    del avals, name, default_fn, kernels
    return default.out_avals, default.effects


def _impl(*args, **params):
    """Eager call: compiled for the default backend (its platform's rule picks the form)."""
    return jax.jit(functools.partial(_kernel_p.bind, **params))(*args)


#: The mesh axis a sharded program splits its batch over (``polestar_jax.sharding``'s ``data``).
BATCH_AXIS = "data"


def _per_shard(fn: Callable) -> Callable:
    """``fn`` (a compiled kernel of flat operands, traced when lowered) as each device's call on its own rows
    when the program is lowered under a mesh of several devices (``jax.set_mesh``: the engine enters its
    mesh): XLA cannot partition a Mosaic or Triton call itself, so the call becomes a ``shard_map`` over the
    mesh, the rows split over :data:`BATCH_AXIS` where it divides the batch and every other axis replicated
    (each device holds its rows whole; every kernel treats the rows of its leading batch axis
    independently). Without such a mesh, ``fn`` itself."""
    def call(*xs):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.size == 1 or mesh.manual_axes:
            return fn(*xs)
        rows = mesh.shape.get(BATCH_AXIS, 1)
        split = rows > 1 and all(x.ndim and x.shape[0] % rows == 0 for x in xs)
        spec = PartitionSpec(BATCH_AXIS) if split else PartitionSpec()
        return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(xs), out_specs=spec, check_vma=False)(*xs)
    return call


def _lowering(platform: Optional[str]):
    def rule(ctx, *args, name, default, default_fn, kernels):
        del name, default_fn
        fn = dict(kernels).get(platform) if platform is not None else None
        if fn is None:
            fn = jex_core.jaxpr_as_fun(default)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    return rule


def _folded(fn: Callable, dims: tuple, size: int) -> Callable:
    """``fn`` over operands with a vmapped axis (``dims``: its position, or None) as one call with that axis
    folded into the leading batch axis: ``[n, b, ...] -> [n * b, ...]`` (unbatched operands broadcast),
    outputs ``[n * b, ...] -> [n, b, ...]``. Valid because every kernel of this package treats the rows
    of its leading batch axis independently (all operands and outputs have it first)."""
    def call(*xs):
        full = [jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
                for x, d in zip(xs, dims)]
        outs = fn(*[x.reshape((size * x.shape[1],) + x.shape[2:]) for x in full])
        return [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs]
    return call


def _batch(args, dims, *, name, default, default_fn, kernels):
    """vmap (a running batch's per-row program): the same equation with the vmapped axis folded into the
    kernels' batch axis (:func:`_folded`), so the kernels keep their grid (Pallas's own batching of the
    Mosaic row-DMA kernels does not lower: their HBM operands must be whole blocks)."""
    dims = tuple(dims)  # (None: not mapped)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    fold = lambda fn: _folded(fn, dims, size)
    del default  # (its jaxpr is specialised to the unbatched shapes: the function is traced again)
    folded_default = fold(default_fn)
    out = _kernel_p.bind(*args, name=name, default=jax.make_jaxpr(folded_default)(*args), default_fn=folded_default,
                         kernels=tuple((p, fold(fn)) for p, fn in kernels))
    return out, [0] * len(out)


_kernel_p.def_effectful_abstract_eval(_abstract_eval)
_kernel_p.def_impl(_impl)
mlir.register_lowering(_kernel_p, _lowering(None))
for _platform in FLAVORS:
    mlir.register_lowering(_kernel_p, _lowering(_platform), platform=_platform)
batching.primitive_batchers[_kernel_p] = _batch
