"""Checkpoint IO: Hugging Face LLaDA / Dream safetensors <-> our params pytree <-> orbax.

The params pytree (a plain nested dict; layer weights stacked over layers on axis 0; linear weights stored
``[in, out]``, the transpose of HF/PyTorch's ``[out, in]``)::

    params = {
      "wte":     [V, D],               # model.transformer.wte.weight
      "blocks": {
        "attn_norm": [N, D],           # model.transformer.blocks.{i}.attn_norm.weight
        "wq":        [N, D, H*hd],     # blocks.{i}.q_proj.weight   (HF [H*hd, D], transposed)
        "wk":        [N, D, KV*hd],    # blocks.{i}.k_proj.weight
        "wv":        [N, D, KV*hd],    # blocks.{i}.v_proj.weight
        "wo":        [N, H*hd, D],     # blocks.{i}.attn_out.weight
        "ff_norm":   [N, D],           # blocks.{i}.ff_norm.weight
        "w_gate":    [N, D, F],        # blocks.{i}.ff_proj.weight  (the SiLU branch)
        "w_up":      [N, D, F],        # blocks.{i}.up_proj.weight
        "w_down":    [N, F, D],        # blocks.{i}.ff_out.weight
      },
      "ln_f":    [D],                  # model.transformer.ln_f.weight
      "lm_head": [D, V],               # model.transformer.ff_out.weight (HF [V, D], transposed)
    }

with ``V = embedding_size``, ``D = d_model``, ``N = n_layers``, ``H = n_heads``, ``KV = n_kv_heads``,
``hd = D // H``, ``F = mlp_hidden_size``.

Dream (``model_type`` "Dream", the Qwen2 layout) uses the same pytree plus the q/k/v biases
``blocks/bq`` [N, H*hd], ``blocks/bk`` / ``blocks/bv`` [N, KV*hd], from the HF Qwen2 names
(``_QWEN2_BLOCK_TENSORS``): ``model.embed_tokens.weight`` -> wte, ``model.layers.{i}.input_layernorm`` ->
attn_norm, ``self_attn.{q,k,v}_proj.{weight,bias}`` -> wq/bq, wk/bk, wv/bv, ``self_attn.o_proj`` -> wo,
``post_attention_layernorm`` -> ff_norm, ``mlp.{gate,up,down}_proj`` -> w_gate, w_up, w_down,
``model.norm.weight`` -> ln_f, ``lm_head.weight`` -> lm_head (untied).

LLaDA-MoE (``architectures`` ["LLaDAMoEModelLM"]) has Qwen2's attention names without biases, no dense MLP,
``self_attn.{q,k}_norm.weight`` -> ``blocks/q_norm``, ``k_norm`` [N, hd], the router ``mlp.gate.weight`` [E, D] ->
``blocks/router`` [N, D, E], and ``mlp.experts.{e}.{gate,up,down}_proj.weight`` stacked per layer and expert into
``blocks/e_gate``, ``e_up`` [N, E, D, F] and ``e_down`` [N, E, F, D] (``_MOE_BLOCK_TENSORS``).

Two on-disk formats are read by :func:`load_model`:

* an HF folder: ``config.json`` + ``model.safetensors`` (or shards listed in ``model.safetensors.index.json``);
* a converted folder written by :func:`save_converted`: ``config.json`` (with ``"polestar_format": "orbax"``)
  + an orbax checkpoint of the params pytree in ``params/``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from polestar_jax.config import ModelConfig
from polestar_jax.errors import CheckpointError, ConfigError
from polestar_jax.io.safetensors_io import LazyTensors, read_safetensors, write_safetensors

__all__ = [
    "Params", "HF_PREFIX", "CONFIG_FILE", "SAFETENSORS_FILE", "INDEX_FILE", "PARAMS_SUBDIR", "FORMAT_KEY",
    "resolve_dtype", "param_shapes", "hf_shapes", "validate_params", "count_params", "params_dtype",
    "hf_to_params", "params_to_hf", "read_hf_folder", "is_hf_folder", "is_converted_folder",
    "load_model", "save_converted", "export_hf", "copy_aux_files", "require_folder", "AUX_FILES",
]

Params = dict[str, Any]
DTypeLike = Union[None, str, np.dtype, type]

HF_PREFIX = "model.transformer."
CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PARAMS_SUBDIR = "params"
FORMAT_KEY = "polestar_format"  # config.json marker of a folder written by save_converted
FORMAT_VALUE = "orbax"

# Per-layer tensors: params["blocks"][key][i] <-> HF "blocks.{i}.{hf_name}.weight"; transposed if linear.
_BLOCK_TENSORS: tuple[tuple[str, str, bool], ...] = (
    ("attn_norm", "attn_norm", False),
    ("wq", "q_proj", True),
    ("wk", "k_proj", True),
    ("wv", "v_proj", True),
    ("wo", "attn_out", True),
    ("ff_norm", "ff_norm", False),
    ("w_gate", "ff_proj", True),
    ("w_up", "up_proj", True),
    ("w_down", "ff_out", True),
)
# Top-level tensors: params[key] <-> HF "{hf_name}.weight"; transposed if linear.
_TOP_TENSORS: tuple[tuple[str, str, bool], ...] = (
    ("wte", "wte", False),
    ("ln_f", "ln_f", False),
    ("lm_head", "ff_out", True),
)

# Dream (Qwen2 layout, HF Qwen2 tensor names): per-layer tensors as ``model.layers.{i}.<name>``, top-level
# tensors by full name; the q/k/v biases go to ``blocks/bq|bk|bv`` ([N, H*hd], [N, KV*hd]).
_QWEN2_BLOCK_TENSORS: tuple[tuple[str, str, bool], ...] = (
    ("attn_norm", "input_layernorm.weight", False),
    ("wq", "self_attn.q_proj.weight", True),
    ("bq", "self_attn.q_proj.bias", False),
    ("wk", "self_attn.k_proj.weight", True),
    ("bk", "self_attn.k_proj.bias", False),
    ("wv", "self_attn.v_proj.weight", True),
    ("bv", "self_attn.v_proj.bias", False),
    ("wo", "self_attn.o_proj.weight", True),
    ("ff_norm", "post_attention_layernorm.weight", False),
    ("w_gate", "mlp.gate_proj.weight", True),
    ("w_up", "mlp.up_proj.weight", True),
    ("w_down", "mlp.down_proj.weight", True),
)
_QWEN2_TOP_TENSORS: tuple[tuple[str, str, bool], ...] = (
    ("wte", "model.embed_tokens.weight", False),
    ("ln_f", "model.norm.weight", False),
    ("lm_head", "lm_head.weight", True),
)
# LLaDA-V (HF LLaVA names): the LM in the Llama layout (Qwen2's names, no biases); the SigLIP tower from the main
# checkpoint under params["vision"] (its ``blocks`` stacked over the tower's layers; the patch convolution kept
# [C, 3, p, p]; post_layernorm kept though the features skip it), the mlp2x_gelu projector under
# params["projector"] and ``image_newline`` [D].
_SIGLIP_PREFIX = "model.vision_tower.vision_tower.vision_model."
_LLAVA_TOP_TENSORS: tuple[tuple[str, str, bool], ...] = _QWEN2_TOP_TENSORS + (
    ("image_newline", "model.image_newline", False),
    ("projector/w1", "model.mm_projector.0.weight", True), ("projector/b1", "model.mm_projector.0.bias", False),
    ("projector/w2", "model.mm_projector.2.weight", True), ("projector/b2", "model.mm_projector.2.bias", False),
    ("vision/patch_w", _SIGLIP_PREFIX + "embeddings.patch_embedding.weight", False),
    ("vision/patch_b", _SIGLIP_PREFIX + "embeddings.patch_embedding.bias", False),
    ("vision/pos_emb", _SIGLIP_PREFIX + "embeddings.position_embedding.weight", False),
    ("vision/post_ln_w", _SIGLIP_PREFIX + "post_layernorm.weight", False),
    ("vision/post_ln_b", _SIGLIP_PREFIX + "post_layernorm.bias", False),
)
_SIGLIP_LAYER_TENSORS: tuple[tuple[str, str, bool], ...] = tuple(
    (f"{key}_{'w' if kind == 'weight' else 'b'}", f"{name}.{kind}", kind == "weight" and linear)
    for key, name, linear in (("ln1", "layer_norm1", False), ("q", "self_attn.q_proj", True),
                              ("k", "self_attn.k_proj", True), ("v", "self_attn.v_proj", True),
                              ("o", "self_attn.out_proj", True), ("ln2", "layer_norm2", False),
                              ("fc1", "mlp.fc1", True), ("fc2", "mlp.fc2", True))
    for kind in ("weight", "bias"))
# LLaDA-MoE (HF Llama/OLMoE names, MOE_SPEC.md section 3): attention as Qwen2's without biases, the per-head
# q/k-norm weights [hd], the router ``mlp.gate`` [E, D] -> blocks/router [N, D, E], and the experts
# ``mlp.experts.{e}.*`` stacked per layer: blocks/e_gate, e_up [N, E, D, F], e_down [N, E, F, D]
_MOE_BLOCK_TENSORS: tuple[tuple[str, str, bool], ...] = tuple(
    t for t in _QWEN2_BLOCK_TENSORS if t[0] in ("attn_norm", "wq", "wk", "wv", "wo")) + (
    ("q_norm", "self_attn.q_norm.weight", False), ("k_norm", "self_attn.k_norm.weight", False),
    ("router", "mlp.gate.weight", True), ("e_gate", "mlp.experts.{e}.gate_proj.weight", True),
    ("e_up", "mlp.experts.{e}.up_proj.weight", True), ("e_down", "mlp.experts.{e}.down_proj.weight", True),
    ("ff_norm", "post_attention_layernorm.weight", False),
)
#: ModelConfig.family -> (per-layer name format, block tensors, top-level tensors), full HF names; the
#: top-level keys are params paths ("projector/w1").
_NAME_MAPS = {
    "llada": (HF_PREFIX + "blocks.{i}.{name}.weight", _BLOCK_TENSORS,
              tuple((k, f"{HF_PREFIX}{n}.weight", t) for k, n, t in _TOP_TENSORS)),
    "dream": ("model.layers.{i}.{name}", _QWEN2_BLOCK_TENSORS, _QWEN2_TOP_TENSORS),
    "llada_v": ("model.layers.{i}.{name}", tuple(t for t in _QWEN2_BLOCK_TENSORS if t[0] not in ("bq", "bk", "bv")),
                _LLAVA_TOP_TENSORS),
    "llada_moe": ("model.layers.{i}.{name}", _MOE_BLOCK_TENSORS, _QWEN2_TOP_TENSORS),
}
#: ModelConfig.family -> further layer stacks: (params path of the stack, HF name format, tensors, layer count)
_EXTRA_STACKS = {
    "llada_v": (("vision/blocks", _SIGLIP_PREFIX + "encoder.layers.{i}.{name}", _SIGLIP_LAYER_TENSORS,
                 lambda cfg: cfg.vision.n_layers),),
}

_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "f16": "float16", "half": "float16", "float": "float32"}


# ----------------------------------------------------------------------------------------------- shapes

def resolve_dtype(dtype: DTypeLike) -> Optional[np.dtype]:
    """``None`` or a floating dtype (``"float32"``, ``"bfloat16"``, ``"float16"``, ``jnp.bfloat16``, ...)
    as a numpy dtype; anything else raises :class:`ConfigError`."""
    if dtype is None:
        return None
    name = dtype
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
        if name == "bfloat16":
            return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(name)
    except TypeError:
        raise ConfigError(f"unknown dtype {dtype!r} (use float32, bfloat16 or float16)") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ConfigError(f"dtype {dtype!r} is not a floating-point type (use float32, bfloat16 or float16)")
    return dt


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The params pytree of ``cfg`` with a shape tuple at each leaf (see the module docstring)."""
    d, n, f, v = cfg.d_model, cfg.n_layers, cfg.mlp_hidden_size, cfg.embedding_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    blocks = {
        "attn_norm": (n, d), "wq": (n, d, q), "wk": (n, d, kv), "wv": (n, d, kv), "wo": (n, q, d),
        "ff_norm": (n, d), "w_gate": (n, d, f), "w_up": (n, d, f), "w_down": (n, f, d),
    }
    if cfg.include_qkv_bias:  # Dream: q/k/v biases
        blocks.update(bq=(n, q), bk=(n, kv), bv=(n, kv))
    if cfg.moe is not None:  # LLaDA-MoE: routed experts instead of the dense MLP, per-head q/k-norm
        e = cfg.moe.n_experts
        for name in ("w_gate", "w_up", "w_down"):
            del blocks[name]
        blocks.update(router=(n, d, e), e_gate=(n, e, d, f), e_up=(n, e, d, f), e_down=(n, e, f, d))
        if cfg.moe.qk_norm:
            blocks.update(q_norm=(n, cfg.head_dim), k_norm=(n, cfg.head_dim))
    out = {"wte": (v, d), "blocks": blocks, "ln_f": (d,), "lm_head": (d, v)}
    if cfg.vision is not None:  # LLaDA-V: the tower, the projector and the newline row
        out.update(cfg.vision.param_shapes(d))
    return out


@dataclasses.dataclass(frozen=True)
class _HFEntry:
    """Where one HF tensor goes: the params leaf at path ``key`` (``"ln_f"``, ``"blocks/wq"``,
    ``"vision/patch_w"``), at index ``layer`` of its stack for a per-layer tensor."""

    key: str
    layer: Union[None, int, tuple[int, int]]  # (layer, expert) for LLaDA-MoE's stacked experts
    transpose: bool
    shape: tuple[int, ...]  # the HF shape


def _hf_entries(cfg: ModelConfig) -> dict[str, _HFEntry]:
    """HF tensor name (with the ``model.transformer.`` prefix) -> :class:`_HFEntry`, in HF order."""
    shapes = dict(_iter_leaves(param_shapes(cfg)))  # params path -> shape
    out: dict[str, _HFEntry] = {}

    def hf_shape(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
        return tuple(reversed(shape)) if transpose else tuple(shape)

    def stack(path: str, fmt: str, tensors: tuple, n_layers: int) -> None:
        for i in range(n_layers):
            for key, hf_name, transpose in tensors:
                if f"{path}/{key}" not in shapes:  # an optional tensor (LLaDA-MoE's q/k-norm) this model lacks
                    continue
                shape = shapes[f"{path}/{key}"]
                for e in range(shape[1]) if "{e}" in hf_name else (None,):  # LLaDA-MoE: one tensor per expert
                    out[fmt.format(i=i, name=hf_name.replace("{e}", str(e)))] = _HFEntry(
                        f"{path}/{key}", i if e is None else (i, e), transpose,
                        hf_shape(shape[1 if e is None else 2:], transpose))

    layer_fmt, block_tensors, top_tensors = _NAME_MAPS[cfg.family]
    key, hf_name, transpose = top_tensors[0]  # the embedding comes first, as in HF order
    out[hf_name] = _HFEntry(key, None, transpose, hf_shape(shapes[key], transpose))
    stack("blocks", layer_fmt, block_tensors, cfg.n_layers)
    for key, hf_name, transpose in top_tensors[1:]:
        out[hf_name] = _HFEntry(key, None, transpose, hf_shape(shapes[key], transpose))
    for path, fmt, tensors, n_layers in _EXTRA_STACKS.get(cfg.family, ()):
        stack(path, fmt, tensors, n_layers(cfg))
    return out


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> HF shape (``[out, in]`` for linear layers) for every tensor of ``cfg``."""
    return {name: e.shape for name, e in _hf_entries(cfg).items()}


def _iter_leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in tree.items():
        if isinstance(v, Mapping):
            yield from _iter_leaves(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def _unflatten(flat: Mapping[str, Any]) -> Params:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}`` (insertion order), top level in the LM's order (wte, blocks,
    ln_f, lm_head), then the rest."""
    tree: Params = {}
    for path, leaf in flat.items():
        *head, last = path.split("/")
        node = tree
        for part in head:
            node = node.setdefault(part, {})
        node[last] = leaf
    top = [k for k in ("wte", "blocks", "ln_f", "lm_head") if k in tree]
    return {k: tree[k] for k in top + [k for k in tree if k not in top]}


def validate_params(params: Mapping[str, Any], cfg: ModelConfig, source: str = "params") -> None:
    """Checks that ``params`` has exactly the keys and shapes of ``cfg`` (floating dtypes); raises
    :class:`CheckpointError` naming the first offending entry (e.g. ``blocks/wq``)."""
    want = dict(_iter_leaves(param_shapes(cfg)))
    if not isinstance(params, Mapping):
        raise CheckpointError(f"{source}: expected a dict of arrays, got {type(params).__name__}")
    have = dict(_iter_leaves(params))
    missing = [k for k in want if k not in have]
    if missing:
        raise CheckpointError(f"{source}: missing parameter {missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = [k for k in have if k not in want]
    if extra:
        raise CheckpointError(f"{source}: unexpected parameter {extra[0]}"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for k, shape in want.items():
        leaf = have[k]
        if tuple(np.shape(leaf)) != shape:
            raise CheckpointError(f"{source}: parameter {k} has shape {tuple(np.shape(leaf))}, "
                                  f"config expects {shape}")
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise CheckpointError(f"{source}: parameter {k} has non-floating dtype {leaf.dtype}")


def count_params(params: Mapping[str, Any]) -> int:
    """Total number of scalars in ``params``."""
    return int(sum(int(np.prod(np.shape(x))) for _, x in _iter_leaves(params)))


def params_dtype(params: Mapping[str, Any]) -> str:
    """The dtype name shared by all leaves (e.g. ``"bfloat16"``), or ``"mixed"``."""
    names = {np.dtype(x.dtype).name for _, x in _iter_leaves(params)}
    return names.pop() if len(names) == 1 else "mixed"


# -------------------------------------------------------------------------------------- HF <-> params

def _canonical_names(tensors: Mapping[str, Any], expected: Mapping[str, Any] = {}) -> dict[str, str]:
    """Canonical HF name (``model.transformer.*``) -> name used in ``tensors`` (which may omit ``model.``;
    a name among ``expected`` is canonical as it is, e.g. Qwen2's ``lm_head.weight``)."""
    out: dict[str, str] = {}
    for name in tensors:
        canon = name if name.startswith("model.") or name in expected else "model." + name
        if canon in out:
            raise CheckpointError(f"tensor {canon} appears twice (as {out[canon]!r} and {name!r})")
        out[canon] = name
    return out


def _matched_names(tensors: Mapping[str, Any], cfg: ModelConfig, entries: Mapping[str, Any]) -> dict[str, str]:
    """:func:`_canonical_names` of ``tensors``, checked to be exactly the tensors of ``entries``
    (:class:`CheckpointError` naming the first unexpected or missing one)."""
    names = _canonical_names(tensors, entries)
    extra = sorted(n for n in names if n not in entries)
    if extra:
        kind = {"llada": "LLaDA", "dream": "Dream", "llada_v": "LLaDA-V", "llada_moe": "LLaDA-MoE"}.get(
            cfg.family, cfg.family)
        raise CheckpointError(f"unexpected tensor {names[extra[0]]} in checkpoint (not part of a {kind} model "
                              f"with {cfg.n_layers} layers)"
                              + (f"; {len(extra) - 1} more unexpected" if len(extra) > 1 else ""))
    missing = [n for n in entries if n not in names]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]} in checkpoint"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return names


def hf_to_params(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, dtype: DTypeLike = None) -> Params:
    """Maps HF LLaDA tensors to the params pytree (numpy arrays).

    Args:
        tensors: ``{name: array}`` with HF names ``model.transformer.*`` (``transformer.*`` also accepted)
            and HF shapes (linear weights ``[out, in]``); e.g. the output of :func:`read_hf_folder`.
        cfg: the model config the tensors must match.
        dtype: cast floating weights to this dtype (``None`` keeps the checkpoint's dtype).

    Returns:
        The params pytree (module docstring) of fresh, C-contiguous numpy arrays: layer weights stacked on
        axis 0, linear weights transposed to ``[in, out]``.

    Raises:
        CheckpointError: a missing, unexpected, mis-shaped or non-floating tensor (the message names it).
    """
    want = resolve_dtype(dtype)
    entries = _hf_entries(cfg)
    names = _matched_names(tensors, cfg, entries)
    shapes = dict(_iter_leaves(param_shapes(cfg)))
    params: dict[str, np.ndarray] = {}  # params path -> array
    for name, e in entries.items():  # one lookup per tensor: a LazyTensors reads each tensor once, here
        arr = np.asarray(tensors[names[name]])
        if tuple(arr.shape) != e.shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(arr.shape)}, config expects {e.shape}")
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise CheckpointError(f"tensor {name} has non-floating dtype {arr.dtype}")
        if e.transpose:
            arr = arr.T
        if e.layer is None:
            params[e.key] = np.array(arr, dtype=want or arr.dtype, order="C")  # a fresh C-contiguous copy
            continue
        stack = params.get(e.key)
        dt = want or (arr.dtype if stack is None else np.promote_types(stack.dtype, arr.dtype))
        if stack is None:
            stack = params[e.key] = np.empty(shapes[e.key], dt)
        elif stack.dtype != dt:  # layers of mixed dtypes: the stack takes their promoted dtype (exact)
            stack = params[e.key] = stack.astype(dt)
        stack[e.layer] = arr  # casts (round-to-nearest-even) when dtype is given
    return _unflatten(params)


def params_to_hf(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of :func:`hf_to_params`: ``{"model.transformer.*": array}`` with HF shapes (``[out, in]``),
    C-contiguous numpy arrays in the params' dtype (bit-exact)."""
    validate_params(params, cfg)
    out: dict[str, np.ndarray] = {}
    host = {k: np.asarray(v) for k, v in _iter_leaves(params)}  # one device->host copy per leaf
    for name, e in _hf_entries(cfg).items():
        arr = host[e.key] if e.layer is None else host[e.key][e.layer]
        out[name] = np.ascontiguousarray(arr.T if e.transpose else arr)
    return out


# ---------------------------------------------------------------------------------------------- reading

def require_folder(path: Union[str, os.PathLike]) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path):
        if os.path.exists(path):
            raise CheckpointError(f"model path is not a folder: {path}")
        raise CheckpointError(f"model folder not found: {path}")
    return path


def is_hf_folder(path: Union[str, os.PathLike]) -> bool:
    """True if ``path`` holds ``model.safetensors`` or ``model.safetensors.index.json``."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, SAFETENSORS_FILE)) or os.path.isfile(os.path.join(path, INDEX_FILE))


def _read_config_dict(path: str) -> dict:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        return {}
    try:
        with open(cfg_path) as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # ModelConfig.from_json reports it properly
    return d if isinstance(d, dict) else {}


def is_converted_folder(path: Union[str, os.PathLike]) -> bool:
    """True if ``path`` was written by :func:`save_converted` (config marker or a ``params/`` folder)."""
    path = os.fspath(path)
    return (_read_config_dict(path).get(FORMAT_KEY) == FORMAT_VALUE
            or os.path.isdir(os.path.join(path, PARAMS_SUBDIR)))


def read_hf_folder(path: Union[str, os.PathLike]) -> LazyTensors:
    """The tensors of an HF folder: ``model.safetensors``, or the shards listed in
    ``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``).

    Every file's header is checked now; each tensor is read from its file when looked up
    (:class:`~polestar_jax.io.safetensors_io.LazyTensors`). With an index, the index is authoritative: exactly
    the listed tensors are returned, each from its shard; a listed shard file that is missing, or a listed
    tensor absent from its shard, raises :class:`CheckpointError`.
    """
    path = require_folder(path)
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                index = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index_path}: invalid JSON ({str(e).splitlines()[0]})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no 'weight_map' object mapping tensor names to shard files")
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
                raise CheckpointError(f"{index_path}: tensor {name}: invalid shard file name {shard!r}")
            by_shard.setdefault(shard, []).append(name)
        files: dict[str, str] = {}
        for shard, names in by_shard.items():
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise CheckpointError(f"{index_path}: shard file {shard} (holding tensor {names[0]}) not found")
            have = read_safetensors(shard_path)
            absent = [n for n in names if n not in have]
            if absent:
                raise CheckpointError(f"{shard_path}: tensor {absent[0]} listed in {INDEX_FILE} is missing "
                                      "from this shard")
            files.update(dict.fromkeys(names, shard_path))
        return LazyTensors(files)
    single = os.path.join(path, SAFETENSORS_FILE)
    if os.path.isfile(single):
        return read_safetensors(single)
    if any(os.path.isfile(os.path.join(path, f)) for f in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise CheckpointError(f"{path}: only safetensors checkpoints are supported (found pytorch_model.bin); "
                              "re-save the model with safe_serialization=True")
    raise CheckpointError(f"{path}: no {SAFETENSORS_FILE} or {INDEX_FILE} in the folder "
                          f"(and no {PARAMS_SUBDIR}/ of a converted checkpoint)")


def _orbax():
    import orbax.checkpoint as ocp  # imported lazily: slow to import and only needed for converted folders

    return ocp


def _read_orbax_params(params_dir: str, cfg: ModelConfig, shardings: Any = None) -> Params:
    """Restores the params saved by :func:`save_converted` as jax arrays on the default device, or with
    ``shardings`` (a pytree of shardings or a mesh; each process restores only its shards)."""
    ocp = _orbax()
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"converted checkpoint folder not found: {params_dir}")
    ckptr = ocp.StandardCheckpointer()
    try:
        try:
            meta = ckptr.metadata(params_dir)
        except Exception as e:  # noqa: BLE001 - orbax raises many types for a corrupt folder
            raise CheckpointError(f"{params_dir}: not a readable orbax checkpoint "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        if not isinstance(tree, Mapping):
            raise CheckpointError(f"{params_dir}: orbax checkpoint does not hold a params dict")
        validate_params(tree, cfg, source=params_dir)
        device = jax.devices()[0]
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype,
                                           sharding=jax.sharding.SingleDeviceSharding(device)),
            dict(tree), is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
        if shardings is not None:
            target = jax.tree.map(lambda t, sh: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=sh),
                                  target, _resolve_shardings(shardings, target, cfg))
        try:
            return ckptr.restore(params_dir, target)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{params_dir}: cannot restore orbax checkpoint "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    finally:
        ckptr.close()


# ------------------------------------------------------------------------------- sharded (per-shard) loading

#: safetensors dtype names of the floating types a checkpoint may hold
_ST_FLOAT_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def _resolve_shardings(shardings: Any, abstract: Params, cfg: Optional[ModelConfig] = None) -> Any:
    """A pytree of ``jax.sharding.Sharding`` for ``abstract``: ``shardings`` itself, or, for a
    ``jax.sharding.Mesh``, :func:`polestar_jax.sharding.param_shardings` over it (whole heads per ``cfg``)."""
    if isinstance(shardings, jax.sharding.Mesh):
        from polestar_jax.sharding import param_shardings

        return param_shardings(abstract, shardings, cfg)
    return shardings


def _hf_params_sharded(tensors: LazyTensors, cfg: ModelConfig, want: Optional[np.dtype], shardings: Any) -> Params:
    """What ``jax.device_put(hf_to_params(tensors, cfg, want), shardings)`` gives, bit for bit, built shard by
    shard: every array is made with ``jax.make_array_from_callback``, whose callback reads only the slice
    of the checkpoint a local device holds (safetensors slices of the memory-mapped files), so a process
    materialises its own shards only (multi-process meshes) and no full copy of the weights is made.
    Names, shapes and dtypes are checked from the file headers first, with :func:`hf_to_params`'s messages."""
    import contextlib

    import safetensors

    from polestar_jax.io.safetensors_io import library_errors

    entries = _hf_entries(cfg)
    names = _matched_names(tensors, cfg, entries)
    files = tensors.files
    shapes = dict(_iter_leaves(param_shapes(cfg)))  # params path -> shape
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def tensor_slice(name: str):
            src = names[name]
            path = files[src]
            if path not in handles:
                with library_errors(path):
                    handles[path] = stack.enter_context(safetensors.safe_open(path, framework="numpy"))
            with library_errors(path):
                return handles[path].get_slice(src)

        stored: dict[str, np.dtype] = {}
        for name, e in entries.items():  # headers only
            sl = tensor_slice(name)
            shape, st_dtype = tuple(sl.get_shape()), sl.get_dtype()
            if shape != e.shape:
                raise CheckpointError(f"tensor {name} has shape {shape}, config expects {e.shape}")
            if st_dtype not in _ST_FLOAT_DTYPES:
                raise CheckpointError(f"tensor {name} has non-floating dtype {st_dtype}")
            stored[name] = np.dtype(_ST_FLOAT_DTYPES[st_dtype])
        by_key: dict[tuple[str, bool], list[str]] = {}  # (key, per-layer) -> HF names (layer order)
        for name, e in entries.items():
            by_key.setdefault((e.key, e.layer is not None), []).append(name)
        abstract: dict[str, jax.ShapeDtypeStruct] = {}  # params path -> leaf
        for (key, layered), hf_names in by_key.items():
            dt = want
            if dt is None:  # as hf_to_params: layers of mixed dtypes take their promoted dtype
                dt = stored[hf_names[0]]
                for n in hf_names[1:]:
                    dt = np.promote_types(dt, stored[n])
            abstract[key] = jax.ShapeDtypeStruct(tuple(shapes[key]), dt)
        target = dict(_iter_leaves(_resolve_shardings(shardings, _unflatten(abstract), cfg)))

        def read(name: str, index: tuple) -> np.ndarray:
            e = entries[name]
            sl = tensor_slice(name)
            with library_errors(files[names[name]]):
                arr = sl[tuple(reversed(index)) if e.transpose else tuple(index)]
            return arr.T if e.transpose else arr

        def build(key: str, layered: bool, hf_names: list[str], leaf: jax.ShapeDtypeStruct, sharding):
            def shard(index: tuple) -> np.ndarray:
                index = tuple(index) + (slice(None),) * (len(leaf.shape) - len(index))
                if not layered:
                    arr = read(hf_names[0], index)
                else:
                    depth = 2 if isinstance(entries[hf_names[0]].layer, tuple) else 1  # LLaDA-MoE: [N, E]
                    grid = np.asarray(hf_names, dtype=object).reshape(leaf.shape[:depth])[index[:depth]]
                    rest = tuple(len(range(n)[ix]) for n, ix in zip(leaf.shape[depth:], index[depth:]))
                    parts = [read(n, index[depth:]).astype(leaf.dtype, copy=False) for n in grid.reshape(-1)]
                    arr = (np.stack(parts) if parts else np.zeros((0,) + rest, leaf.dtype)).reshape(grid.shape + rest)
                return np.ascontiguousarray(arr, dtype=leaf.dtype)  # casts as hf_to_params (numpy, RNE)

            return jax.make_array_from_callback(tuple(leaf.shape), sharding, shard)

        out: dict[str, jax.Array] = {}
        for (key, layered), hf_names in by_key.items():
            out[key] = build(key, layered, hf_names, abstract[key], target[key])
    return _unflatten(out)


def load_model(path: Union[str, os.PathLike], dtype: DTypeLike = None,
               shardings: Any = None, config: Optional[ModelConfig] = None,
               transform: Optional[Callable[[Params], Params]] = None) -> tuple[ModelConfig, Params]:
    """Loads a model folder: an HF folder (``config.json`` + ``model.safetensors`` or a sharded index) or a
    folder written by :func:`save_converted` (``config.json`` + orbax ``params/``).

    Args:
        path: the folder.
        dtype: ``None`` (keep the stored dtype), ``"float32"``, ``"bfloat16"``, ``"float16"`` or a
            jnp/numpy dtype: every parameter is cast to it.
        shardings: ``None`` (the default device), a ``jax.sharding.Mesh`` (the layout of
            :func:`polestar_jax.sharding.param_shardings`) or a params pytree of shardings: each array is
            built shard by shard from the checkpoint (safetensors slices; orbax restores with the
            shardings), so each process of a multi-process mesh reads and holds only its own shards.
        config: the model's config instead of the folder's ``config.json`` (e.g. with a mask id the file
            lacks: a golden LLaDA-MoE folder keeps it in ``cases.json``).
        transform: a function of the params pytree applied before it is returned (int8 weights:
            :func:`polestar_jax.models.quant.quantize_params`). An HF folder loaded without ``shardings`` passes
            it the host arrays, so a transform that returns device arrays leaf by leaf (quantization) never
            holds the whole float model on the device; the other paths apply it to the loaded arrays.

    Returns:
        ``(cfg, params)`` with params a pytree of jax arrays on the default device (module docstring),
        or placed with ``shardings``.

    Raises:
        CheckpointError: missing folder/files, corrupt or mismatched checkpoint.
        ConfigError: missing/invalid ``config.json`` or an unsupported architecture.
    """
    path = require_folder(path)
    want = resolve_dtype(dtype)
    cfg = config or ModelConfig.from_json(os.path.join(path, CONFIG_FILE))
    if is_converted_folder(path):
        params = _read_orbax_params(os.path.abspath(os.path.join(path, PARAMS_SUBDIR)), cfg, shardings)
        if want is not None:
            params = jax.tree.map(lambda x: x.astype(want), params)
        return cfg, (transform or _same)(params)
    if shardings is not None:
        return cfg, (transform or _same)(_hf_params_sharded(read_hf_folder(path), cfg, want, shardings))
    params = (transform or _same)(hf_to_params(read_hf_folder(path), cfg, dtype=want))
    return cfg, jax.tree.map(jnp.asarray, params)


def _same(params: Params) -> Params:
    return params


GENERATION_FILE = "generation_config.json"
_GENERATION_KEYS = ("gen_length", "block_length", "steps")


def generation_defaults(path: Union[str, os.PathLike]) -> dict[str, int]:
    """Decoding lengths a model folder recommends: the integer ``gen_length`` / ``block_length`` / ``steps``
    keys of its ``generation_config.json`` (a model trained for one answer length, like the bundled
    ``tiny_tasks``, sets them); ``{}`` when the file or the keys are absent.

    Raises:
        CheckpointError: the file exists but is not a JSON object, or a key is not a positive integer.
    """
    f = os.path.join(os.fspath(path), GENERATION_FILE)
    if not os.path.isfile(f):
        return {}
    try:
        with open(f) as fh:
            d = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {f}: {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{f} is not a JSON object")
    out = {}
    for k in _GENERATION_KEYS:
        if k in d:
            v = d[k]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise CheckpointError(f"{f}: {k} must be a positive integer, got {v!r}")
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------------- writing

def _config_json(cfg: ModelConfig, params: Mapping[str, Any], extra_config: Optional[Mapping[str, Any]],
                 **fields: Any) -> dict:
    """``extra_config`` (e.g. the source ``config.json``) overridden by ``cfg.to_hf_dict()`` and ``fields``,
    with ``torch_dtype`` set to the params' dtype."""
    d = {k: v for k, v in (extra_config or {}).items() if k != FORMAT_KEY}
    d.update(cfg.to_hf_dict())
    d["torch_dtype"] = params_dtype(params)
    d.update(fields)
    return d


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write ({e.strerror or e})") from None


def _make_dir(out_dir: Union[str, os.PathLike]) -> str:
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"output path exists and is not a folder: {out_dir}")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create output folder {out_dir} ({e.strerror or e})") from None
    return out_dir


def save_converted(out_dir: Union[str, os.PathLike], cfg: ModelConfig, params: Mapping[str, Any], *,
                   extra_config: Optional[Mapping[str, Any]] = None) -> str:
    """Writes a converted folder: an orbax checkpoint of ``params`` in ``out_dir/params/`` and
    ``out_dir/config.json`` (``cfg.to_hf_dict()`` + ``torch_dtype`` + ``"polestar_format": "orbax"``; extra
    fields of ``extra_config``, e.g. the source HF config, are kept under ours).

    Overwriting: ``out_dir`` may exist; its ``params/`` and ``config.json`` are replaced (params are
    written first, the config last, so a failed save never looks like a valid checkpoint); other files in
    it are left alone. Returns when everything is on disk. Returns the absolute ``out_dir``.
    """
    validate_params(params, cfg)
    out_dir = _make_dir(out_dir)
    config_path = os.path.join(out_dir, CONFIG_FILE)
    if os.path.exists(config_path):
        os.remove(config_path)
    ocp = _orbax()
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(os.path.join(out_dir, PARAMS_SUBDIR), dict(params), force=True)
        ckptr.wait_until_finished()
    finally:
        ckptr.close()
    _write_json(config_path, _config_json(cfg, params, extra_config, **{FORMAT_KEY: FORMAT_VALUE}))
    return out_dir


def _shard_names(names: list[str], sizes: dict[str, int], max_shard_bytes: Optional[int]) -> list[list[str]]:
    """Splits ``names`` (in order) greedily into shards of at most ``max_shard_bytes`` (a tensor larger than
    the limit gets a shard of its own)."""
    if max_shard_bytes is None:
        return [names]
    shards: list[list[str]] = [[]]
    used = 0
    for n in names:
        if shards[-1] and used + sizes[n] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(n)
        used += sizes[n]
    return shards


def export_hf(out_dir: Union[str, os.PathLike], cfg: ModelConfig, params: Mapping[str, Any],
              max_shard_bytes: Optional[int] = None, *, extra_config: Optional[Mapping[str, Any]] = None) -> list[str]:
    """Writes an HF folder: ``config.json`` + ``model.safetensors``, or, when ``max_shard_bytes`` is given and
    the tensors do not fit in one file, shards ``model-0000i-of-0000n.safetensors`` +
    ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {...}}``).

    Tensors are written in the params' dtype with HF names/shapes (:func:`params_to_hf`); the safetensors
    metadata is ``{"format": "pt"}`` as transformers expects. Any ``model*.safetensors`` and index left in
    ``out_dir`` from an earlier export are removed first. Returns the written safetensors file names.
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ConfigError(f"max shard size must be positive, got {max_shard_bytes}")
    tensors = params_to_hf(params, cfg)
    out_dir = _make_dir(out_dir)
    for f in os.listdir(out_dir):
        if f == INDEX_FILE or (f.startswith("model") and f.endswith(".safetensors")):
            os.remove(os.path.join(out_dir, f))
    names = list(tensors)
    sizes = {n: tensors[n].nbytes for n in names}
    shards = _shard_names(names, sizes, max_shard_bytes)
    meta = {"format": "pt"}
    if len(shards) == 1:
        files = [SAFETENSORS_FILE]
        write_safetensors(os.path.join(out_dir, SAFETENSORS_FILE), tensors, metadata=meta)
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map: dict[str, str] = {}
        for fname, shard in zip(files, shards):
            write_safetensors(os.path.join(out_dir, fname), {n: tensors[n] for n in shard}, metadata=meta)
            weight_map.update({n: fname for n in shard})
        _write_json(os.path.join(out_dir, INDEX_FILE),
                    {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})
    _write_json(os.path.join(out_dir, CONFIG_FILE), _config_json(cfg, params, extra_config))
    return files


#: The tokenizer, chat-template, generation and remote-code files a conversion carries over (LLaDA's, LLaDA-MoE's
#: and Dream's: a Dream folder may hold its Qwen2 tokenizer as vocab.json + merges.txt).
AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
             "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
             "configuration_llada.py", "modeling_llada.py", "configuration_lladamoe.py", "modeling_lladamoe.py",
             "configuration_dream.py", "modeling_dream.py", "generation_utils.py", "tokenization_dream.py")


def copy_aux_files(src_dir: Union[str, os.PathLike], dst_dir: Union[str, os.PathLike],
                   names: tuple[str, ...] = AUX_FILES) -> list[str]:
    """Copies the tokenizer / generation / remote-code files among ``names`` (default :data:`AUX_FILES`) that
    exist in ``src_dir`` to ``dst_dir``; returns the copied names."""
    copied = []
    for name in names:
        src = os.path.join(os.fspath(src_dir), name)
        if os.path.isfile(src):
            try:
                shutil.copyfile(src, os.path.join(os.fspath(dst_dir), name))
            except OSError as e:
                raise CheckpointError(f"cannot copy {src} ({e.strerror or e})") from None
            copied.append(name)
    return copied

