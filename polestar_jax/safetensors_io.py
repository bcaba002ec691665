"""A small, strict reader/writer for the safetensors format, built on numpy + ml_dtypes.

File layout (all integers little-endian)::

    [8 bytes]  N = length of the JSON header, unsigned 64-bit
    [N bytes]  JSON object: {"<name>": {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [begin, end]},
                             ..., "__metadata__": {"<str>": "<str>"}}   (__metadata__ optional)
    [rest]     raw tensor bytes; ``data_offsets`` are relative to the start of this section

:func:`read_safetensors` memory-maps the file, so reading a multi-GB checkpoint costs no copy until the
tensors are used. Every malformed input raises :class:`~polestar_jax.errors.CheckpointError` with a
one-line message naming the file and the problem.
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
from typing import Any, Mapping, Optional

import ml_dtypes
import numpy as np

from polestar_jax.errors import CheckpointError

__all__ = ["DTYPES", "read_safetensors", "read_safetensors_header", "write_safetensors"]

# safetensors dtype tag -> numpy dtype (little-endian).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(np.bool_),
}
# numpy dtype (native-order, byte order ignored) -> safetensors tag.
_TAGS: dict[np.dtype, str] = {dt.newbyteorder("="): tag for tag, dt in DTYPES.items()}

# Refuse absurd header lengths before allocating (the reference implementation uses 100 MB).
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_METADATA_KEY = "__metadata__"


def _parse_header(path: str, f, file_size: int) -> tuple[dict[str, dict], dict[str, str], int]:
    """Reads and validates the header of the open file ``f``.

    Returns ``(entries, metadata, data_start)``: the tensor entries by name (validated dtype/shape/offsets,
    offsets checked against the file size), the ``__metadata__`` dict, and the byte offset of the data
    section.
    """
    if file_size < 8:
        raise CheckpointError(f"{path}: not a safetensors file (only {file_size} bytes, need at least 8)")
    (header_len,) = struct.unpack("<Q", f.read(8))
    if header_len > file_size - 8:
        raise CheckpointError(
            f"{path}: header length {header_len} is beyond the file size ({file_size} bytes); "
            "file truncated or not safetensors")
    if header_len > _MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: header length {header_len} exceeds the {_MAX_HEADER_BYTES}-byte limit")
    raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON header ({str(e).splitlines()[0]})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: invalid header (expected a JSON object, got {type(header).__name__})")

    metadata = header.pop(_METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in metadata.items()):
        raise CheckpointError(f"{path}: invalid __metadata__ (expected a string-to-string object)")

    data_start = 8 + header_len
    data_size = file_size - data_start
    entries: dict[str, dict] = {}
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise CheckpointError(f"{path}: tensor {name!r}: header entry needs dtype, shape and data_offsets")
        tag = info["dtype"]
        if tag not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r}: unknown dtype {tag!r} "
                                  f"(supported: {', '.join(DTYPES)})")
        shape = info["shape"]
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise CheckpointError(f"{path}: tensor {name!r}: invalid shape {shape!r}")
        offsets = info["data_offsets"]
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: tensor {name!r}: invalid data_offsets {offsets!r}")
        begin, end = offsets
        nbytes = math.prod(shape) * DTYPES[tag].itemsize
        if end - begin != nbytes:
            raise CheckpointError(
                f"{path}: tensor {name!r}: data_offsets {offsets} span {end - begin} bytes but "
                f"{tag}{list(shape)} needs {nbytes}")
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated data: tensor {name!r} ends at byte {end} of the data section, "
                f"which has only {data_size} bytes")
        entries[name] = {"dtype": tag, "shape": tuple(shape), "begin": begin, "end": end}
    return entries, metadata, data_start


def _open_checked(path: str | os.PathLike):
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"safetensors file not found: {path}")
    try:
        return path, open(path, "rb"), os.path.getsize(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror or e})") from None


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, dict], dict[str, str]]:
    """Validates ``path`` and returns its header without touching the tensor data.

    Returns ``(entries, metadata)`` where ``entries[name] = {"dtype": tag, "shape": tuple, "begin": int,
    "end": int}`` (offsets relative to the data section) and ``metadata`` is the ``__metadata__`` dict.
    """
    path, f, size = _open_checked(path)
    with f:
        entries, metadata, _ = _parse_header(path, f, size)
    return entries, metadata


def read_safetensors(path: str | os.PathLike, *, mmap: bool = True,
                     names: Optional[set[str] | list[str]] = None) -> dict[str, np.ndarray]:
    """Reads all tensors of a safetensors file.

    Args:
        path: the ``.safetensors`` file.
        mmap: if True (default) the arrays are read-only views of a memory map of the file (no copy, pages
            are read on first access; the file must not be modified while they are alive). If False every
            tensor is copied into ordinary writable memory.
        names: read only these tensors; a name absent from the file raises :class:`CheckpointError`.

    Returns:
        ``{name: array}`` with the file's shapes and dtypes (``BF16`` -> ``ml_dtypes.bfloat16``), in file
        header order.
    """
    path, f, size = _open_checked(path)
    with f:
        entries, _, data_start = _parse_header(path, f, size)
        if names is not None:
            absent = [n for n in names if n not in entries]
            if absent:
                raise CheckpointError(f"{path}: tensor {absent[0]!r} not found in the file"
                                      + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""))
            wanted = set(names)
            entries = {n: e for n, e in entries.items() if n in wanted}
        if not mmap:
            out: dict[str, np.ndarray] = {}
            for name, e in entries.items():
                f.seek(data_start + e["begin"])
                buf = f.read(e["end"] - e["begin"])
                if len(buf) != e["end"] - e["begin"]:  # the file shrank under us
                    raise CheckpointError(f"{path}: truncated data while reading tensor {name!r}")
                out[name] = np.frombuffer(bytearray(buf), dtype=DTYPES[e["dtype"]]).reshape(e["shape"])
            return out
    if size == data_start:  # no tensor bytes at all: np.memmap cannot map an empty region
        return {n: np.empty(e["shape"], DTYPES[e["dtype"]]) for n, e in entries.items()}
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start)
    return {n: np.frombuffer(data, dtype=DTYPES[e["dtype"]], count=math.prod(e["shape"]),
                             offset=e["begin"]).reshape(e["shape"])
            for n, e in entries.items()}


def _as_array(name: str, value: Any) -> np.ndarray:
    """``value`` as a C-contiguous little-endian numpy array with a supported dtype."""
    arr = np.asarray(value)  # also pulls jax arrays to host
    if arr.dtype.newbyteorder("=") not in _TAGS:
        raise CheckpointError(f"cannot write tensor {name!r}: unsupported dtype {arr.dtype}")
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.asarray(arr, order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, Any],
                      metadata: Optional[Mapping[str, str]] = None) -> None:
    """Writes ``tensors`` (``{name: numpy/jax array}``) to ``path`` in safetensors format.

    Tensors are laid out in name order, the header is padded with spaces to a multiple of 8 bytes (as the
    reference implementation does), and the file is written to ``path + ".tmp"`` first and renamed, so an
    interrupted write never leaves a half-written file under ``path``. ``metadata`` must map str -> str.
    """
    path = os.fspath(path)
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"{path}: metadata must map strings to strings")
    arrays: dict[str, np.ndarray] = {}
    for name in sorted(tensors):
        if not isinstance(name, str) or name == _METADATA_KEY:
            raise CheckpointError(f"{path}: invalid tensor name {name!r}")
        arrays[name] = _as_array(name, tensors[name])

    header: dict[str, Any] = {}
    if metadata:
        header[_METADATA_KEY] = dict(metadata)
    offset = 0
    for name, arr in arrays.items():
        tag = _TAGS[arr.dtype.newbyteorder("=")]
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)

    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for arr in arrays.values():
                if arr.nbytes:
                    f.write(memoryview(arr.reshape(-1).view(np.uint8)))
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise CheckpointError(f"{path}: cannot write ({e.strerror or e})") from None
