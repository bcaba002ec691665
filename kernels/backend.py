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

Where the platform is chosen:

* by default, when the computation is *traced*, for this process's default backend
  (``jax.default_backend()``: what a plain ``jax.jit`` lowers for; a jit placed on another backend of the
  same host, with ``jax.default_device`` or ``backend=``, must trace inside :func:`staged`): only the chosen
  implementation is traced. (Staging out the Triton, Mosaic and reference versions of every kernel call
  cost Polestar's block program 0.6-1.0 s of its 1.9-2.3 s of tracing and lowering on the 2-core CPU:
  bench/README.md, compile time.)
* inside :func:`staged` (:func:`polestar_jax.compat.export` enters it), when it is *lowered*, with
  :func:`jax.lax.platform_dependent`: ``jax.export(..., platforms=["cuda"])`` of an ``auto`` call from a
  CPU-only host gets the Triton kernel, ``platforms=["tpu"]`` the Mosaic kernel. (Export one platform at a
  time: a multi-platform export lowers every branch for every platform, and Pallas kernels only lower for
  their own. From a machine without a GPU, export through :func:`polestar_jax.compat.export`: jax >= 0.12
  needs the target GPU named for the Triton lowering.)

Staged, every branch is traced on every platform, so each kernel must trace anywhere: in particular
jax >= 0.12 bounds-checks ref slices with a static start at trace time, and the Triton flavours pad the
small operands they read as static whole-block slices to the block sizes (tests/test_compat.py traces
every branch at shapes no block divides).

:func:`resolve_backend` answers the same question eagerly for a concrete platform (default: the default
JAX backend), for callers that want to pick an implementation outside of a trace.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
from jax import lax

from polestar_jax import compat

KINDS = ("auto", "pallas", "interpret", "reference")

# Platforms (as named by jax.export / lax.platform_dependent) with a compiled Pallas lowering, per kernel.
# A kernel/platform pair that is absent falls back to the reference under "auto" (and to the interpreter
# under "pallas"). tests/test_export.py checks this table both ways: every listed pair lowers, and every
# pair that is absent is served by the reference when exported with "auto".
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
             interpret_flavor: str = "triton"):
    """Calls the implementation of kernel ``name`` that ``backend`` selects.

    ``reference(*args)`` is the jnp reference; ``pallas(flavor, interpret)`` returns a function of ``args``
    running the Pallas kernel of that flavour ("triton" | "mosaic"), compiled or interpreted.
    ``interpret_flavor``: which flavour the interpreter runs for ``backend="interpret"``.
    """
    check_kind(backend)
    if backend == "reference":
        return reference(*args)
    if backend == "interpret":
        return pallas(interpret_flavor, True)(*args)
    if not compat.kernels_staged():  # (chosen now, for the backend a plain jax.jit lowers for)
        plat = _canonical_platform(None)
        kind = resolve_backend(backend, plat, name)
        if kind == "reference":
            return reference(*args)
        return pallas(FLAVORS[plat], False)(*args) if kind == "pallas" else pallas(interpret_flavor, True)(*args)
    branches = {plat: pallas(FLAVORS[plat], False) for plat in sorted(SUPPORTED[name]) if plat in FLAVORS}
    default = reference if backend == "auto" else pallas(interpret_flavor, True)
    return lax.platform_dependent(*args, default=default, **branches)
