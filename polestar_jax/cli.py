"""What every command-line entry point shares: the one-line argument parser, exit codes, clean interrupts,
strict UTF-8 input and the JSON output contract.

Exit codes: 0 success, 1 a check failed (crosscheck), 2 bad input (one ``error: ...`` line on stderr),
130 interrupted (SIGINT; one ``interrupted`` line on stderr).

Interrupts. A Python ``KeyboardInterrupt`` can only be raised between bytecodes of the main thread, so it
is lost inside long C++ calls (XLA compilation, a blocking device read) and, when it lands in a garbage
collector callback, it is printed and ignored. :func:`run_main` therefore runs the command in a worker
thread and keeps the main thread free to take the signal: the handler waits (bounded) for a compilation
cache entry that is being written and for :func:`atomic_write` renames to finish, prints ``interrupted``
and ends the process with ``os._exit(130)``. No destructor or exit hook runs, so nothing can crash on the
way out, and because files are only ever renamed into place whole, nothing is left half-written.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import signal
import sys
import threading
from typing import Any, Callable, NoReturn, Optional, Sequence

from polestar_jax.errors import PolestarError
from polestar_jax.io.files import (WRITE_LOCK, atomic_write, need_folder,  # noqa: F401 (the faces' file helpers)
                                   read_utf8_lines, writing)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

_INTERRUPT_WAIT_S = 1.5


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one ``error: ...`` line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {' '.join(message.split())}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _on_interrupt(signum, frame) -> None:  # runs in the main thread
    WRITE_LOCK.acquire(timeout=_INTERRUPT_WAIT_S)
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a closed pipe must not stop the exit
        pass
    os.write(2, b"interrupted\n")
    os._exit(EXIT_INTERRUPTED)


def _ignore_interrupts_in_teardown() -> None:
    """atexit, the first hook to run: the command is over; the exit hooks (JAX's among them) and the
    interpreter's teardown follow (native libraries' destructors may take a second), where a SIGINT would
    raise inside a hook or, once Python has no handler left, kill the process by the signal. Ignored
    instead: the process ends with the command's status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_main(fn: Callable[[Optional[Sequence[str]]], int], argv: Optional[Sequence[str]] = None) -> int:
    """Runs ``fn(argv)`` as a command: ``PolestarError`` -> one ``error:`` line and exit 2, SIGINT at
    any moment -> ``interrupted`` and exit 130 (see the module docstring; once the process exits, in its
    exit hooks and the interpreter's teardown, it is ignored). Returns the exit status."""
    if threading.current_thread() is not threading.main_thread():  # called from a test thread etc.
        return report_errors(fn, argv)
    previous = signal.signal(signal.SIGINT, _on_interrupt)
    result: dict[str, Any] = {}

    def work():
        try:
            result["rc"] = report_errors(fn, argv)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            result["exc"] = e

    t = _start_worker(work)
    try:
        while t.is_alive():
            t.join(0.05)
    finally:
        # (registered last, after the hooks the command's imports registered: atexit runs it first)
        atexit.unregister(_ignore_interrupts_in_teardown)
        atexit.register(_ignore_interrupts_in_teardown)
        signal.signal(signal.SIGINT, previous)
    if "exc" in result:
        raise result["exc"]
    return result.get("rc", EXIT_FAILED)


_WORK_STACK_BYTES = 64 << 20  # address space: pages are only touched as the stack grows


def _start_worker(target: Callable[[], None]) -> threading.Thread:
    """Starts the command's worker thread with a 64 MiB stack: XLA compiles, and serializes what it compiled
    for the persistent cache, on the calling thread, recursing in C++, and a secondary thread gets the
    platform's default stack (8 MiB with glibc and the usual ``ulimit -s``, less elsewhere). Where a
    thread of that size cannot start, the default size is used."""
    try:
        return _start_thread(target, _WORK_STACK_BYTES)
    except (ValueError, RuntimeError):  # no such stack size here, or no room for it
        return _start_thread(target, 0)


def _start_thread(target: Callable[[], None], stack_bytes: int) -> threading.Thread:
    previous = threading.stack_size(stack_bytes)  # (applies to the threads started while it is set)
    try:
        t = threading.Thread(target=target, name="polestar-main", daemon=True)
        t.start()
        return t
    finally:
        threading.stack_size(previous)


def report_errors(fn: Callable[[Optional[Sequence[str]]], int], argv: Optional[Sequence[str]] = None) -> int:
    """Runs ``fn(argv)`` and returns its exit status: a ``PolestarError`` becomes one ``error:`` line on stderr
    and status 2, a ``SystemExit`` (argparse) its own code. No interrupt handling (see :func:`run_main`), so
    a command that must save on Ctrl-C, such as training, can use it."""
    try:
        return int(fn(argv) or 0)
    except PolestarError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # argparse's --help (0) and Parser.error (2)
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)


def check_utf8(text: str, what: str) -> str:
    """Raises a one-line :class:`PolestarError` if ``text`` (a command-line string, decoded by Python with
    surrogate escapes) holds bytes that are not valid UTF-8; names ``what`` and the byte offset."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        offset = len(text[: e.start].encode("utf-8", "surrogateescape"))
        raise PolestarError(f"{what} is not valid UTF-8 (byte offset {offset})") from None
    return text


def print_json(obj: Any) -> None:
    """The JSON output contract: one object, on the last line of stdout (warnings and progress go to
    stderr)."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# --- flags generated from config dataclasses -------------------------------------------------------------

def _flag_name(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


class _NoneGiven:
    """The value of a flag given as ``none`` (a plain None means "not given")."""

    def __repr__(self):
        return "none"


NONE = _NoneGiven()


def _none_or_float(v: str):
    if v.lower() == "none":
        return NONE
    try:
        return float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {v!r} (a number or 'none')") from None


def _default_text(value) -> str:
    return "none" if value is None else str(value)


def add_config_flags(group, cls, skip: Sequence[str] = ()) -> list[str]:
    """Adds one flag per :func:`polestar_jax.config.knob` field of the dataclass ``cls`` to ``group``; the
    help says what the field does and its default (the field's, or its ``cli_default``). Values the user
    does not give stay ``None`` in the namespace (bool flags: unset), so :func:`given_config_values` can
    tell given from default. Returns the field names added."""
    import typing

    hints = typing.get_type_hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta or f.name in skip:
            continue
        default = meta.get("cli_default", f.default)
        shown = "" if default is None else f" (default: {_default_text(default)})"
        flags = [_flag_name(f), *meta.get("aliases", ())]
        tp = hints[f.name]
        if tp is bool:  # shown as its --no-... flag when on by default; the positive spelling also works
            on, off = flags, [meta["negate"]] if meta.get("negate") else []
            state = "on" if default else "off"
            visible, hidden = (off, on) if default and off else (on, off)
            text = f"{meta['help']} (default: {state})".replace("%", "%%")
            group.add_argument(*visible, dest=f.name, action="store_false" if visible is off else "store_true",
                               default=None, help=text)
            if hidden:
                group.add_argument(*hidden, dest=f.name, default=None, help=argparse.SUPPRESS,
                                   action="store_false" if hidden is off else "store_true")
            names.append(f.name)
            continue
        text = (meta["help"] + shown).replace("%", "%%")
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": text}
        if meta.get("choices"):
            kw["choices"] = list(meta["choices"])
        elif tp in (int, Optional[int]):
            kw["type"] = int
        elif tp in (float, Optional[float]):
            kw["type"] = _none_or_float if meta.get("none") else float
        group.add_argument(*flags, **kw)
        names.append(f.name)
    return names


def given_config_values(args, cls, names: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """The fields of ``cls`` the user gave on the command line (see :func:`add_config_flags`)."""
    out = {}
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        v = getattr(args, f.name, None)
        if v is not None:
            out[f.name] = None if v is NONE else v
    return out


def flag_of(cls, name: str, value: Any = None) -> str:
    """The command-line flag of field ``name`` of ``cls`` (for a bool field given as False, its ``--no-...``
    flag)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if value is False and f.metadata.get("negate"):
        return f.metadata["negate"]
    return _flag_name(f)


def flag_namer(values: dict, *classes) -> Callable[[str], str]:
    """``name -> flag`` for error messages: a field of one of ``classes`` (the first that has it) by
    :func:`flag_of` with its value in ``values``; any other name as ``--name-with-dashes``."""
    def flag(name: str) -> str:
        for cls in classes:
            if name in {f.name for f in dataclasses.fields(cls)}:
                return flag_of(cls, name, values.get(name))
        return "--" + name.replace("_", "-")

    return flag


# --- multi-process runs (JAX's multi-controller runtime) -------------------------------------------------

def add_distributed_flags(ap) -> None:
    """``--coordinator HOST:PORT --num-processes N --process-id I --join-timeout S``: join a multi-process
    runtime (:func:`polestar_jax.sharding.join_runtime`; default: ``JAX_COORDINATOR_ADDRESS`` /
    ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, or a cluster JAX detects)."""
    g = ap.add_argument_group("multi-process (one mesh over several processes or hosts; default: the "
                              "JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID environment, or a "
                              "SLURM / TPU / Kubernetes cluster JAX detects)")
    g.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                   help="address of process 0, which runs the coordinator and listens on PORT")
    g.add_argument("--num-processes", metavar="N", type=int, default=None, help="number of processes")
    g.add_argument("--process-id", metavar="I", type=int, default=None, help="this process's id, 0..N-1")
    g.add_argument("--join-timeout", metavar="S", type=float, default=None,
                   help="seconds to wait for the coordinator and every process before failing "
                        "(default: $POLESTAR_JAX_JOIN_TIMEOUT or 300)")


def join_from_args(args) -> bool:
    """Joins the multi-process runtime the flags of :func:`add_distributed_flags` (or the environment)
    describe, before anything uses a device. Returns whether this is a multi-process run. When it is,
    native libraries' chatter on the stdout file descriptor (gloo's connection lines) is sent to stderr,
    so stdout carries only what the command prints (results, the JSON line)."""
    from polestar_jax import sharding

    joined = sharding.join_runtime(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                                   getattr(args, "process_id", None), getattr(args, "join_timeout", None))
    if joined:
        _native_stdout_to_stderr()
    return joined


def _native_stdout_to_stderr() -> None:
    """Points file descriptor 1 at stderr and ``sys.stdout`` at a duplicate of the old descriptor 1."""
    try:
        if sys.stdout.fileno() != 1:  # already redirected (or captured): leave it
            return
        sys.stdout.flush()
        out = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = os.fdopen(out, "w", buffering=1, encoding=sys.stdout.encoding or "utf-8",
                               errors=sys.stdout.errors or "strict")
    except (OSError, ValueError, AttributeError):  # no real stdout: nothing to protect
        pass
