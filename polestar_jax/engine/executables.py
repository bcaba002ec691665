"""Compiled programs kept on disk and found *without tracing* (the executable store).

JAX's persistent compilation cache is keyed by the lowered program, so a hit still pays for tracing and
lowering it (~1.3 s for Polestar's block program on the 2-core CPU, while loading takes ~0.3 s). The engine
knows its programs by a key of plain values instead (the program kind, its :class:`EngineSpec` and the
shapes, dtypes and shardings of its arguments: ``Engine._program``), so it can store the serialized
executable (:mod:`jax.experimental.serialize_executable`) under a digest of that key and, in a later
process, load it straight away.

A stored program is only valid for the code and the setup that built it, so the digest also covers: the
source of this package (every ``.py`` file of ``polestar_jax`` and its kernels, read at import), the JAX
and jaxlib versions, Python's, the backend and its device kind, the host CPU's model and flags,
``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS``, and JAX's trace context (matmul precision, x64, ...:
:func:`polestar_jax.compat.trace_context`). Anything else that changes a program changes its key or
its arguments' signature; a changed digest is a miss, never a wrong hit.

Only programs XLA compiled in this process are stored (:func:`freshly_compiled`): an executable that JAX's
persistent cache loaded serializes without its kernels (on the CPU, its copy fails when run, with
"Function ... not found"), so a program found there -- or found in JAX's in-memory cache holding such a
load -- is traced as before and stored the next time XLA compiles it.

The store lives in ``executables/`` of JAX's persistent cache folder (``jax_compilation_cache_dir``, which
the CLIs set from ``$POLESTAR_JAX_CACHE``: on when that cache is on, off with it), holds at most
:data:`MAX_ENTRIES` programs (the least recently used go first) and is skipped for programs whose arguments
lie on several devices and in multi-process runs. An entry that
cannot be read or loaded (another version, a torn file) is deleted and the program compiled as usual; a
stored program that fails when run is not detected (delete the folder). Like the persistent cache, the
folder holds native code, and loading an entry unpickles it: on POSIX an entry is read only when it and
the folder belong to this process's user and neither is writable by the group or others
(:func:`trusted`); otherwise the store is skipped (one warning) and programs compile as usual.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import time
import warnings
import weakref
from typing import Any, Optional

__all__ = ["MAX_ENTRIES", "store_folder", "digest", "freshly_compiled", "trusted", "load", "save"]

#: Programs kept in the store (each is a few MB for the bundled model; the oldest read go first).
MAX_ENTRIES = 64
#: An XLA compile of an engine program takes longer than this; an answer of JAX's in-memory cache is a lookup.
FRESH_MIN_SECONDS = 0.01
_SUFFIX = ".exe"
_LOADED: "weakref.WeakSet" = weakref.WeakSet()  # executables JAX's persistent cache loaded in this process


def freshly_compiled(compiled, seconds: float, cache_hit: bool) -> bool:
    """Whether ``compiled`` (what ``Lowered.compile()`` returned after ``seconds``; ``cache_hit``: JAX's
    persistent cache reported loading it) is XLA's own compile from this process, which alone serializes
    whole: not a persistent-cache load, not an in-memory answer holding one (remembered here), and not any
    in-memory answer at all (those take microseconds)."""
    exe = getattr(compiled, "_executable", None)
    if exe is None:
        return False
    if cache_hit:
        try:
            _LOADED.add(exe)
        except TypeError:  # pragma: no cover - not weakly referable in this JAX
            pass
        return False
    try:
        if exe in _LOADED:
            return False
    except TypeError:  # pragma: no cover
        return False
    return seconds >= FRESH_MIN_SECONDS


def store_folder() -> Optional[str]:
    """The store's folder: ``executables/`` in JAX's persistent cache folder, or None when that cache is
    off, JAX runs several processes, or this JAX cannot serialize executables."""
    import jax

    base = jax.config.jax_compilation_cache_dir
    if not base or jax.process_count() > 1:
        return None
    try:
        import jax.experimental.serialize_executable  # noqa: F401
    except ImportError:  # pragma: no cover - a JAX without it
        return None
    return os.path.join(base, "executables")


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """sha256 of this package's Python source (the kernels included), read once per process."""
    import polestar_jax
    import polestar_jax.kernels

    h = hashlib.sha256()
    for pkg in (polestar_jax, polestar_jax.kernels):
        root = os.path.dirname(os.path.abspath(pkg.__file__))
        for dirpath, dirnames, files in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _host_cpu() -> str:
    """This host's CPU model and instruction-set flags (XLA's CPU code is built for them), from
    ``/proc/cpuinfo`` where there is one, else the machine name."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(dict.fromkeys(lines))
    except OSError:
        import platform

        return platform.machine() + " " + platform.processor()


def digest(key: Any) -> Optional[str]:
    """The store's name for the program of ``key`` (a tuple of plain values whose ``repr`` names it: the
    engine's program key) built by this code on this setup; None when the setup cannot be named (then the
    program is not stored)."""
    import jax
    import jaxlib

    from polestar_jax import compat

    context = compat.trace_context()
    if context is None:
        return None
    dev = jax.devices()[0]
    parts = (_code_fingerprint(), jax.__version__, jaxlib.__version__, sys.version_info[:2], jax.default_backend(),
             dev.device_kind, getattr(dev.client, "platform_version", ""), _host_cpu(),
             os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""), context, repr(key))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def trusted(path: str) -> bool:
    """Whether the store may read ``path`` (its folder or an entry): on POSIX, it belongs to this process's
    user and is not writable by the group or others (unpickling an entry runs code); elsewhere, True."""
    if os.name != "posix":
        return True
    st = os.stat(path)
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


_UNTRUSTED_WARNED: set = set()


def _warn_untrusted(folder: str) -> None:
    if folder not in _UNTRUSTED_WARNED:
        _UNTRUSTED_WARNED.add(folder)
        warnings.warn(f"polestar-jax: not using the executable store {folder}: it and its entries must belong to "
                      "this user and be writable by it only (chown, chmod -R go-w); programs compile as usual",
                      stacklevel=3)


def load(folder: str, name: str):
    """The compiled program stored as ``name`` (:func:`digest`), or None (not stored, not :func:`trusted`,
    or unreadable: then the entry is removed). Marks it as recently used."""
    from jax.experimental.serialize_executable import deserialize_and_load

    path = os.path.join(folder, name + _SUFFIX)
    try:
        if not (trusted(folder) and trusted(path)):
            _warn_untrusted(folder)
            return None
    except OSError:  # no folder or no entry yet
        return None
    try:
        with open(path, "rb") as f:
            payload, in_tree, out_tree = pickle.load(f)
        compiled = deserialize_and_load(payload, in_tree, out_tree)
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a torn or foreign entry: drop it, compile as usual
        _remove(path)
        return None
    try:
        os.utime(path)
    except OSError:
        pass
    return compiled


def save(folder: str, name: str, compiled) -> bool:
    """Stores ``compiled`` (a ``jax.stages.Compiled``) as ``name``, atomically, then trims the store to
    :data:`MAX_ENTRIES`; False when it cannot be serialized or written (nothing is stored then)."""
    from jax.experimental.serialize_executable import serialize

    from polestar_jax.io.files import atomic_write

    try:
        blob = pickle.dumps(serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if not trusted(folder):  # (nothing would read it back)
            _warn_untrusted(folder)
            return False
        atomic_write(os.path.join(folder, name + _SUFFIX), blob)
    except Exception:  # noqa: BLE001 - not serializable here (or the disk refused): just not stored
        return False
    _trim(folder)
    return True


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _trim(folder: str, keep: int = MAX_ENTRIES) -> None:
    """Removes the least recently used entries beyond ``keep`` (and temporary files over an hour old)."""
    entries = []
    now = time.time()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            mtime = os.path.getmtime(path)
        except OSError:
            continue
        if name.startswith(".tmp-"):  # (io.files.atomic_write's: another process may be writing it)
            if now - mtime > 3600:
                _remove(path)
        elif name.endswith(_SUFFIX):
            entries.append((mtime, path))
    for _, path in sorted(entries, reverse=True)[keep:]:
        _remove(path)


_code_fingerprint()  # (read now, with the code as imported, not at the first compile)
