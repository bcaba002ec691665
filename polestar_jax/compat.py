"""The one place for code that depends on the installed JAX version.

Supported: jax 0.10.2 (the oldest checked; the newest release for Python 3.11) up to the 0.12 series. The
rest of the package calls the helpers here instead of testing versions itself. Features are detected from
the installed API where possible (not from version numbers), so a release in between behaves like the
side of the change it is on.

* :func:`compute_on_host`: run a jitted function on the host (``compute_on("device_host")``). Up to jax 0.11
  ``compute_on`` is a context manager / decorator taking the compute type positionally; from 0.12 it is a
  function decorator with keyword-only ``compute_type`` and ``out_memory_spaces``.
* :func:`export` / :func:`lowering_target`: ``jax.export`` for ``cuda`` from a machine without a GPU. Up to
  jax 0.11 the Pallas Triton lowering assumed compute capability 9.0 when no GPU was present; from 0.12 it
  reads the target GPU from the abstract mesh and fails without one ("No supported GPU devices found"), so
  these set an abstract ``NVIDIA H100`` (the same 9.0) while lowering. On a machine with a GPU they change
  nothing.

Not a version switch, but the reason the kernels look as they do (see :mod:`polestar_jax.kernels.backend`):
from jax 0.12 a Pallas ref slice with a *static* start is bounds-checked at trace time (0.10 skipped the
check when the start was 0), and an export staged for every platform (:func:`export`, with
:func:`jax.lax.platform_dependent`) traces every platform's branch, so the Triton kernels are traced on CPU
too. The kernels therefore never slice a ref statically past its end: the small operands are padded to the
kernel's block sizes in the wrapper (one code path for every version).

``python -m polestar_jax.compat`` prints the versions that matter (Python, jax, jaxlib, flax, orbax, ...).
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import platform
import re
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

import jax
from jax.experimental.compute_on import compute_on as _compute_on

__all__ = ["JAX_VERSION", "MIN_JAX", "COMPUTE_ON_KEYWORD_ONLY", "ABSTRACT_GPU_KIND", "parse_version",
           "compute_on_host", "lowering_target", "staged_kernels", "kernels_staged", "export", "versions",
           "version_line", "distributed_joined", "cluster_env_types", "backends_initialized", "trace_context",
           "separate_trace_cache", "wrap_compile_cache_put"]

F = TypeVar("F", bound=Callable)

MIN_JAX = (0, 10, 2)


def parse_version(v: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; pre-release / local suffixes (``rc1``, ``.dev``, ``+cuda``) are
    dropped."""
    out = []
    for part in v.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(out)


JAX_VERSION = parse_version(jax.__version__)


def _compute_on_keyword_only() -> bool:
    try:
        params = inspect.signature(_compute_on).parameters
    except (TypeError, ValueError):  # pragma: no cover - a C-implemented callable
        return JAX_VERSION >= (0, 12)
    p = params.get("compute_type")
    return "out_memory_spaces" in params or (p is not None and p.kind is inspect.Parameter.KEYWORD_ONLY)


# jax >= 0.12: compute_on(f=None, *, compute_type, out_memory_spaces, compiler_options=None)
# jax <= 0.11: compute_on(compute_type) -- a contextlib context manager (usable as a decorator)
COMPUTE_ON_KEYWORD_ONLY = _compute_on_keyword_only()


def compute_on_host(f: F) -> F:
    """``f`` (typically ``jax.jit``-ed) traced to run on the host (``compute_type="device_host"``), its
    outputs left in host memory (``jax.memory.Space.Host``, where the inputs of the offload helpers live).

    Used as a decorator by :mod:`polestar_jax.decode.polestar.offload`; the same lowered module on every supported version
    (a call with ``_xla_compute_type = "host"``)."""
    if COMPUTE_ON_KEYWORD_ONLY:
        return _compute_on(f, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    return _compute_on("device_host")(f)


# The GPU a cuda lowering targets when this machine has none (compute capability 9.0, as jax <= 0.11 assumed).
ABSTRACT_GPU_KIND = "NVIDIA H100"


def _has_local_gpu() -> bool:
    try:
        return bool(jax.local_devices(backend="gpu"))
    except RuntimeError:  # no gpu backend (CPU-only jaxlib, or JAX_PLATFORMS=cpu)
        return False


@contextlib.contextmanager
def lowering_target(platform: str, device_kind: str = ABSTRACT_GPU_KIND) -> Iterator[None]:
    """Context for lowering (``jax.export``, ``.lower``) a computation for ``platform`` on this machine: for
    ``cuda`` on a machine without a GPU, an abstract GPU device of ``device_kind`` (an empty abstract mesh
    carrying it) that the Pallas Triton lowering of jax >= 0.12 reads its target from; otherwise nothing."""
    abstract_device = getattr(jax.sharding, "AbstractDevice", None)
    if platform != "cuda" or abstract_device is None or _has_local_gpu():
        yield
        return
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=abstract_device(
        device_kind=device_kind, num_cores=None, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        yield


_TARGET = contextvars.ContextVar("polestar_program_target", default=None)


@contextlib.contextmanager
def program_target(platform: Optional[str]) -> Iterator[None]:
    """Within: the programs traced and the states built are for devices of ``platform`` (``"cpu"``,
    ``"gpu"``, ``"tpu"``; None: this process's default backend), which may not be this process's (an
    engine whose parameters live on a TPU topology compiles ahead of time from a CPU host). What depends on
    the target rather than on the tracing (where Polestar's store lives: ``decode.polestar.offload``) reads
    :func:`target_platform`."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_platform() -> Optional[str]:
    """The platform set by the innermost :func:`program_target` (None: none set, the default backend's)."""
    return _TARGET.get()


_STAGED = contextvars.ContextVar("polestar_kernels_staged", default=False)


@contextlib.contextmanager
def staged_kernels() -> Iterator[None]:
    """Within: the kernels stage every platform's implementation and the lowering picks one
    (:mod:`polestar_jax.kernels.backend`, where it is ``staged``), in traces kept apart from plain ones in
    JAX's tracing caches (:func:`separate_trace_cache`)."""
    token = _STAGED.set(True)
    try:
        with separate_trace_cache("polestar-kernels-staged"):
            yield
    finally:
        _STAGED.reset(token)


def kernels_staged() -> bool:
    """Whether this thread is inside :func:`staged_kernels`."""
    return _STAGED.get()


def export(fun: Callable, *, platforms: Sequence[str], **kwargs: Any) -> Callable[..., "jax.export.Exported"]:
    """``jax.export.export(fun, platforms=platforms, **kwargs)`` whose call traces the kernels staged for
    every platform (:func:`staged_kernels`) and lowers inside :func:`lowering_target`
    (one platform at a time, as the kernels' dispatch needs; see :mod:`polestar_jax.kernels.backend`)."""
    platforms = tuple(platforms)
    exporter = jax.export.export(fun, platforms=platforms, **kwargs)

    def call(*args, **kw):
        with contextlib.ExitStack() as stack:
            stack.enter_context(staged_kernels())
            for p in set(platforms):
                stack.enter_context(lowering_target(p))
            return exporter(*args, **kw)

    return call


_PACKAGES = ("jax", "jaxlib", "flax", "orbax-checkpoint", "tensorstore", "optax", "chex", "numpy", "ml_dtypes")


def versions() -> dict[str, str]:
    """``{"python": ..., "jax": ..., "jaxlib": ..., "flax": ..., "orbax-checkpoint": ..., ...}`` of this
    interpreter (``"-"`` for a package that is not installed)."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def version_line() -> str:
    """One line: ``python 3.12.1, jax 0.12.0.1, jaxlib 0.12.0.1, flax ..., orbax-checkpoint ..., ...``."""
    return ", ".join(f"{k} {v}" for k, v in versions().items())


if __name__ == "__main__":
    print(version_line())


# ---------------------------------------------------------------------------- JAX internals (jax._src)
# Every use of ``jax._src`` lives here: each is optional, and a JAX layout without it degrades to "unknown".

def distributed_joined() -> bool:
    """Whether this process joined a multi-process runtime (``jax.distributed``)."""
    is_init = getattr(jax.distributed, "is_initialized", None)
    if is_init is not None:
        return bool(is_init())
    from jax._src import distributed  # older JAX

    return distributed.global_state.client is not None


def cluster_env_types() -> list:
    """JAX's registry of cluster environments that ``jax.distributed.initialize()`` auto-detects (SLURM,
    Open MPI, Cloud TPU, Kubernetes; opt-in ones excluded); empty when this JAX has none we can read."""
    try:
        from jax._src import clusters

        return [c for c in clusters.ClusterEnv._cluster_types if not getattr(c, "opt_in_only_method", False)]
    except Exception:  # noqa: BLE001 - another JAX layout: no auto-detection
        return []


def backends_initialized() -> bool:
    """Whether JAX has set up its backends in this process (False when this JAX cannot tell)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # noqa: BLE001
        return False


def trace_context() -> Optional[str]:
    """JAX's trace context (the configuration its tracing caches key on: matmul precision, x64, ...) as text
    that is the same in every process with the same settings (objects' addresses left out); None when this
    JAX does not expose it."""
    try:
        from jax._src import config as _config

        context = _config.trace_context()
    except Exception:  # noqa: BLE001 - another JAX layout
        return None
    return re.sub(r" object at 0x[0-9a-fA-F]+", " object", repr(context))


@contextlib.contextmanager
def separate_trace_cache(marker: str) -> Iterator[None]:
    """Within: JAX's tracing caches key on ``marker`` too, so a function traced here is never answered by a
    trace of it made outside, nor the reverse (the kernels' staged traces, :mod:`polestar_jax.kernels.backend`).
    Done through ``jax_hlo_source_file_canonicalization_regex``, an option of JAX's trace context, extended by
    an alternative that matches nothing (the HLO's metadata stays as it was). A JAX without that option:
    its caches are cleared on entry and on exit instead."""
    try:
        from jax._src import config as _config

        state = _config.hlo_source_file_canonicalization_regex
        current = state.value
    except Exception:  # noqa: BLE001 - another JAX layout: no keyed separation, empty caches on both sides
        jax.clear_caches()
        try:
            yield
        finally:
            jax.clear_caches()
        return
    never = "(?!)" + re.escape(marker)  # (an empty lookahead never holds)
    with state(never if current is None else f"(?:{current})|{never}"):
        yield


def wrap_compile_cache_put(wrap: Callable) -> bool:
    """Replaces the persistent compilation cache's ``put`` with ``wrap(put)`` once (idempotent); False when
    this JAX's cache class is not found."""
    try:
        from jax._src import lru_cache
    except ImportError:  # pragma: no cover - other JAX layouts
        return False
    cls = getattr(lru_cache, "LRUCache", None)
    put = getattr(cls, "put", None)
    if put is None:
        return False
    if not getattr(put, "_polestar_guarded", False):
        new = wrap(put)
        new._polestar_guarded = True
        cls.put = new
    return True
