"""Files as the package writes and reads them: whole or not at all, and with one-line errors.

* :func:`atomic_write` puts a file into place through a temporary file and a rename, under
  :data:`WRITE_LOCK` (:func:`writing`), which the command-line interrupt handler (:mod:`polestar_jax.cli`)
  takes before it ends the process: a write in progress completes first, nothing is left half-written;
* :func:`read_utf8_lines` and :func:`need_folder`: a user's file or folder, or one error line naming it.

The engine's executable store and compilation cache write through here, so they need nothing of the CLI.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import threading

from polestar_jax.errors import PolestarError

#: Held while a file is being put into place (:func:`atomic_write`, compilation-cache entries); the
#: interrupt handler takes it before it exits, so a write in progress completes first.
WRITE_LOCK = threading.RLock()


@contextlib.contextmanager
def writing():
    """Marks a file write the interrupt handler must let finish."""
    with WRITE_LOCK:
        yield


def atomic_write(path: str, data: str | bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file in the same folder and a rename, so a reader
    (or an interrupt) sees the old file or the whole new one."""
    folder = os.path.dirname(os.path.abspath(path))
    mode = "wb" if isinstance(data, bytes) else "w"
    with writing():
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
        try:
            with os.fdopen(fd, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def read_utf8_lines(path: str, what: str = "prompts file") -> list[str]:
    """The lines of a UTF-8 text file; a missing file, a folder or invalid UTF-8 is a one-line error that
    names the file (and the byte offset of the first bad byte)."""
    if os.path.isdir(path):
        raise PolestarError(f"{what} {path} is a folder, not a file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise PolestarError(f"cannot read {what} {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolestarError(f"{what} {path} is not valid UTF-8 (byte offset {e.start})") from None
    return text.splitlines()


def need_folder(path: str, what: str = "model folder") -> str:
    """``path`` if it is a folder; otherwise a one-line error that says whether it is missing or a file."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise PolestarError(f"{what} {path} is a file, not a folder")
    raise PolestarError(f"{what} not found: {path}")
