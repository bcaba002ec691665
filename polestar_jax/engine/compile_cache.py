"""The persistent XLA compilation cache every entry point turns on (the CLIs, :mod:`polestar_jax.api`,
:mod:`polestar_jax.eval`).

``$POLESTAR_JAX_CACHE`` names the folder (default ``~/.cache/polestar_jax/xla``); ``POLESTAR_JAX_CACHE=off``
disables it. With it on, a second process decoding the same shapes loads the executables instead of
compiling them (the bundled model's Polestar block step takes ~12 s to compile).
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Optional

from polestar_jax import compat
from polestar_jax.io.files import writing

__all__ = ["enable_compile_cache", "cache_folder", "cache_hits", "CompileRecord", "compile_summary"]

OFF = "off"


def cache_folder(path: Optional[str] = None) -> Optional[str]:
    """The folder :func:`enable_compile_cache` would use (None when disabled)."""
    path = path or os.environ.get("POLESTAR_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "polestar_jax", "xla")
    return None if path.lower() == OFF else path


def enable_compile_cache(path: Optional[str] = None) -> Optional[str]:
    """Turns on JAX's persistent compilation cache (``$POLESTAR_JAX_CACHE``, default
    ``~/.cache/polestar_jax/xla``; ``POLESTAR_JAX_CACHE=off`` disables it), so a second run of the same
    shapes skips compilation (also in a process that compiled other programs before). Returns the folder
    used, or None."""
    import jax
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    path = cache_folder(path)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
        changed = jax.config.jax_compilation_cache_dir != path
        jax.config.update("jax_compilation_cache_dir", path)
        if changed:
            # JAX decides at the first compile of a process whether its cache is in use and keeps to that:
            # a process that compiled anything before (a script's own jit, a notebook) would use no cache
            reset_cache()
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        guard_compile_cache_writes()
    except OSError:
        return None
    return path


def guard_compile_cache_writes() -> None:
    """Makes JAX's persistent compilation cache entries complete or absent after an interrupt.

    JAX writes a cache entry with one ``write_bytes`` call; the entry's write is wrapped in
    :func:`writing` (the interrupt handler waits for it). A no-op where JAX's cache class is not found."""
    def wrap(put):
        def guarded_put(self, key, value):
            with writing():
                return put(self, key, value)
        return guarded_put

    compat.wrap_compile_cache_put(wrap)


_HITS = threading.local()
_LISTENING = []  # [True] once the listener is registered (one per process)
_LOCK = threading.Lock()
_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def _on_event(event: str, **kwargs) -> None:
    if event == _HIT_EVENT:
        _HITS.n = getattr(_HITS, "n", 0) + 1


def cache_hits() -> int:
    """Executables this thread has loaded from the persistent compilation cache so far (JAX's
    ``jax.monitoring`` cache-hit events; the listener is registered on the first call)."""
    import jax

    with _LOCK:
        if not _LISTENING:
            jax.monitoring.register_event_listener(_on_event)
            _LISTENING.append(True)
    return getattr(_HITS, "n", 0)


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """One program's first use: ``lower_seconds`` tracing and lowering it (JAX; paid even on a persistent-cache
    hit), ``compile_seconds`` XLA compiling it or, with ``cache_hit``, loading it from the persistent cache or
    (``from_store``) from the executable store, which needs no tracing (:mod:`polestar_jax.engine.executables`)."""

    what: str
    lower_seconds: float
    compile_seconds: float
    cache_hit: bool
    from_store: bool = False  # loaded from the executable store (polestar_jax.engine.executables): nothing traced

    @property
    def seconds(self) -> float:
        return self.lower_seconds + self.compile_seconds

    def line(self) -> str:
        """The progress line printed after it."""
        if self.from_store:
            return f"loaded {self.what} from the executable store in {self.seconds:.2f}s (nothing traced)"
        if self.cache_hit:
            return (f"loaded {self.what} from the compilation cache in {self.seconds:.2f}s "
                    f"(tracing and lowering {self.lower_seconds:.2f}s, loading {self.compile_seconds:.2f}s)")
        return (f"compiled {self.what} in {self.seconds:.2f}s "
                f"(tracing and lowering {self.lower_seconds:.2f}s, XLA {self.compile_seconds:.2f}s)")


def compile_summary(records) -> str:
    """What a job's compile seconds were (for the stats line): '' when nothing compiled."""
    records = list(records)
    if not records:
        return ""
    low = sum(r.lower_seconds for r in records)
    hits = sum(r.cache_hit for r in records)
    stored = sum(r.from_store for r in records)
    return (f" (tracing and lowering {low:.2f}s; {hits} of {len(records)} program{'s' if len(records) > 1 else ''}"
            f" from the compilation cache" + (f", {stored} of them from the executable store" if stored else "")
            + ")")
