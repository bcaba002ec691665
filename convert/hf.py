"""Conversion between Hugging Face LLaDA / Dream folders and our converted (orbax) folders."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional, Union

from polestar_jax.io.checkpoint import (CONFIG_FILE, DTypeLike, copy_aux_files, count_params, export_hf,
                                        hf_shapes, hf_to_params, is_converted_folder, load_model, params_dtype,
                                        read_hf_folder, require_folder, resolve_dtype, save_converted)
from polestar_jax.config import ModelConfig
from polestar_jax.errors import CheckpointError

__all__ = ["ConversionSummary", "convert_hf_to_orbax", "convert_orbax_to_hf"]


@dataclasses.dataclass(frozen=True)
class ConversionSummary:
    """What a conversion wrote."""

    n_tensors: int  # HF tensors read or written
    n_params: int  # scalars
    dtype: str  # dtype of the written weights
    out_dir: str  # absolute output folder
    files: tuple[str, ...] = ()  # weight files written (HF export only)

    def line(self, verb: str) -> str:
        """A one-line human summary."""
        shards = f" in {len(self.files)} file(s)" if self.files else ""
        return (f"{verb} {self.n_tensors} tensors ({self.n_params:,} params, {self.dtype}){shards} "
                f"-> {self.out_dir}")


def _check_distinct(src: str, dst: str) -> None:
    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise CheckpointError(f"output folder must differ from the input folder: {dst}")


def _source_config(path: str) -> dict:
    """The source ``config.json`` as a dict (already validated by ModelConfig.from_json)."""
    with open(os.path.join(path, CONFIG_FILE)) as f:
        return json.load(f)


def convert_hf_to_orbax(hf_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike],
                        dtype: DTypeLike = None) -> ConversionSummary:
    """Converts an HF LLaDA or Dream folder (``config.json`` + ``model.safetensors`` or sharded index; the
    family's tensor names, :mod:`polestar_jax.io.checkpoint`) into a converted folder (``config.json`` + orbax
    ``params/``), casting to ``dtype`` if given, and copies the tokenizer / generation config files
    (:data:`~polestar_jax.io.checkpoint.AUX_FILES`). See :func:`polestar_jax.io.checkpoint.save_converted` for
    overwrite behaviour."""
    hf_dir = require_folder(hf_dir)
    out_dir = os.fspath(out_dir)
    _check_distinct(hf_dir, out_dir)
    cfg = ModelConfig.from_json(os.path.join(hf_dir, CONFIG_FILE))
    tensors = read_hf_folder(hf_dir)
    params = hf_to_params(tensors, cfg, dtype=resolve_dtype(dtype))
    out_dir = save_converted(out_dir, cfg, params, extra_config=_source_config(hf_dir))
    copy_aux_files(hf_dir, out_dir)
    return ConversionSummary(len(tensors), count_params(params), params_dtype(params), out_dir)


def convert_orbax_to_hf(src_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike],
                        max_shard_bytes: Optional[int] = None, dtype: DTypeLike = None) -> ConversionSummary:
    """Exports a model folder (converted or HF) as an HF folder (``model.safetensors``, or shards + index when
    ``max_shard_bytes`` is exceeded), casting to ``dtype`` if given, and copies tokenizer files."""
    src_dir = require_folder(src_dir)
    out_dir = os.fspath(out_dir)
    _check_distinct(src_dir, out_dir)
    cfg, params = load_model(src_dir, dtype=dtype)
    extra = _source_config(src_dir) if is_converted_folder(src_dir) else None
    files = export_hf(out_dir, cfg, params, max_shard_bytes, extra_config=extra)
    copy_aux_files(src_dir, out_dir)
    return ConversionSummary(len(hf_shapes(cfg)), count_params(params), params_dtype(params), os.path.abspath(out_dir),
                             tuple(files))
