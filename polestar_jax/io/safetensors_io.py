"""safetensors files through the ``safetensors`` library, with our one-line :class:`CheckpointError` messages.

:func:`read_safetensors` checks a file's header at once and returns a :class:`LazyTensors` that reads one
tensor per lookup (``checkpoint.hf_to_params`` consumes them one at a time). ``ml_dtypes`` must be imported:
the library builds ``BF16`` tensors with the numpy dtype name ``"bfloat16"``, which ``ml_dtypes`` registers.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import struct
from typing import Any, Iterator, Mapping, Optional

import ml_dtypes  # noqa: F401 - registers "bfloat16" with numpy (see the module docstring)
import numpy as np
import safetensors
import safetensors.numpy

from polestar_jax.errors import CheckpointError

__all__ = ["LazyTensors", "read_safetensors", "write_safetensors", "library_errors"]

# A part of the library's message -> ours; {0} is the library's detail (after its last "header: ").
_MESSAGES = (("too small", "not a safetensors file (need at least 8 bytes for the header length)"),
             ("invalid header length", "header length is beyond the file size; file truncated or not safetensors"),
             ("too large", "header length exceeds the library's 100 MB limit; not a safetensors file"),
             ("not fully covered", "truncated data or trailing bytes: the header's tensors do not cover the file"),
             ("expected struct", "invalid header: expected a JSON object ({0})"),
             ("unknown variant", "invalid header: {0}"), ("invalid offset", "invalid data_offsets ({0})"),
             ("invalid JSON", "invalid JSON header ({0})"))


def _size_mismatch(path: str) -> Optional[str]:
    """The first tensor whose byte span does not fit its shape and dtype (the library names neither)."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, e in ((n, e) for n, e in header.items() if n != "__metadata__"):
            bits = 8 if e["dtype"] == "BOOL" else int(re.match(r"\D*(\d+)", e["dtype"]).group(1))
            need, (begin, end) = -(-math.prod(e["shape"]) * bits // 8), e["data_offsets"]
            if end - begin != need:
                return (f"tensor {name!r}: data_offsets {[begin, end]} span {end - begin} bytes but "
                        f"{e['dtype']}{list(e['shape'])} needs {need}")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return None


@contextlib.contextmanager
def library_errors(path: str, writing: bool = False):
    """A context in which the library's errors about ``path`` become one-line :class:`CheckpointError` messages
    (also used by :mod:`polestar_jax.io.checkpoint` for its own reads of shards)."""
    try:
        yield
    except (safetensors.SafetensorError, OSError) + ((TypeError,) if writing else ()) as e:
        lib = " ".join(str(e).split())
        if writing:
            raise CheckpointError(f"{path}: cannot write ({lib})") from None
        detail = re.sub(r"unknown variant `(\w+)`, expected one of .*? at", r"unknown dtype '\1' at",
                        lib.rsplit("header: ", 1)[-1])
        msg = ("invalid shape, data type" in lib and _size_mismatch(path)) or next(
            (ours.format(detail) for part, ours in _MESSAGES if part in lib), f"unreadable safetensors file ({lib})")
        raise CheckpointError(f"{path}: {msg}") from None


class LazyTensors(Mapping[str, np.ndarray]):
    """Tensor name -> numpy array, read from its file ``files[name]`` at each lookup (not kept)."""

    def __init__(self, files: Mapping[str, str]):
        self.files = dict(files)

    def __getitem__(self, name: str) -> np.ndarray:
        with library_errors(self.files[name]), safetensors.safe_open(self.files[name], framework="numpy") as f:
            return f.get_tensor(name)

    def __contains__(self, name: object) -> bool:  # (Mapping's default would read the tensor)
        return name in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def read_safetensors(path: str | os.PathLike) -> LazyTensors:
    """The tensors of ``path`` (header checked now; ``BF16`` -> ``ml_dtypes.bfloat16``)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"safetensors file not found: {path}")
    with library_errors(path), safetensors.safe_open(path, framework="numpy") as f:
        return LazyTensors(dict.fromkeys(f.keys(), path))


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, Any],
                      metadata: Optional[Mapping[str, str]] = None) -> None:
    """Writes ``{name: numpy/jax array}`` to ``path`` through ``path + ".tmp"`` (an interrupted write never
    leaves a half-written ``path``); ``metadata`` maps str -> str."""
    path, arrays = os.fspath(path), {n: np.asarray(np.asarray(v), order="C") for n, v in tensors.items()}
    try:
        with library_errors(path, writing=True):  # (dense C order: the library writes the raw buffer)
            safetensors.numpy.save_file(arrays, path + ".tmp", metadata=dict(metadata) if metadata else None)
            os.replace(path + ".tmp", path)
    finally:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
