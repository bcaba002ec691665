"""Configurations as frozen dataclasses.

* :class:`ModelConfig`: a LLaDA or Dream model's shapes and ids, read from a Hugging Face ``config.json``.
* :class:`DecodeConfig`: which decoder runs (``llada``, ``fastdllm`` or ``polestar``) and its knobs.
* :class:`PolestarConfig`: the knobs of Polestar-Cache and Polestar-Commit (``DecodeConfig.polestar``).
* :class:`Mode` and its str enums (:class:`Decoder`, :class:`Cache`, ...): the allowed values of the mode fields.

Every knob's help text, flag and defaults (:func:`knob`) also build the command-line flags
(:func:`polestar_jax.cli.add_config_flags`) and ``docs/configuration.md`` (``python docs/make_configuration.py``).
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any, Literal, Optional, Sequence

from polestar_jax.errors import ConfigError

# Fields of an HF LLaDA config.json whose value must be exactly this for the architecture we implement.
_REQUIRED_VALUES: dict[str, Any] = {
    "block_type": "llama",
    "layer_norm_type": "rms",
    "activation_type": "silu",
    "rope": True,
    "alibi": False,
    "weight_tying": False,
    "include_bias": False,
    "scale_logits": False,
    "input_emb_norm": False,
    "attention_layer_norm": False,
    "block_group_size": 1,
}
_REQUIRED_FIELDS = ("d_model", "n_heads", "n_layers", "mlp_hidden_size", "vocab_size", "mask_token_id")
# config.json ``model_type`` -> ModelConfig.family
_MODEL_TYPES = {"llada": "llada", "Dream": "dream", "llava_llada": "llada_v"}
# Dream (Qwen2 layout): required fields and fixed values
_DREAM_REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                          "vocab_size")
_DREAM_REQUIRED_VALUES: dict[str, Any] = {"hidden_act": "silu", "tie_word_embeddings": False}


def _check_fields(d: dict, source: str, required: Sequence[str], values: dict) -> None:
    """One-line ``ConfigError`` for a missing ``required`` key of config dict ``d`` or a key whose value is
    given (not None) and differs from the one ``values`` requires."""
    missing = [f for f in required if f not in d]
    if missing:
        raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
    for key, want in values.items():
        if key in d and d[key] is not None and d[key] != want:
            raise ConfigError(f"{source}: unsupported {key}={d[key]!r} (this implementation needs {want!r})")


# LLaDA-V (``model_type`` "llava_llada"): the LM's Llama-layout fields, and the values of the LLaVA keys this
# implementation runs (the official LLaDA-V training script's; LLADA_V_SPEC.md section 0)
_LLAVA_REQUIRED_FIELDS = _DREAM_REQUIRED_FIELDS + ("mm_hidden_size",)
_LLAVA_REQUIRED_VALUES: dict[str, Any] = {
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mm_projector_type": "mlp2x_gelu",
    "mm_patch_merge_type": "spatial_unpad", "mm_use_im_start_end": False, "mm_use_im_patch_token": False}
# SigLIP-so400m-patch14-384 (SigLipVisionConfig's defaults): the tower when no tower config is at hand
_SIGLIP_DEFAULTS = {"hidden_size": 1152, "num_hidden_layers": 27, "num_attention_heads": 16,
                    "intermediate_size": 4304, "layer_norm_eps": 1e-6, "patch_size": 14,
                    "hidden_act": "gelu_pytorch_tanh"}


def parse_grid_pinpoints(value: Any, unit: int, source: str = "config") -> tuple[tuple[int, int], ...]:
    """LLaVA's ``image_grid_pinpoints`` as ``(width, height)`` pixel sizes: a string of ``(axb)`` items is the
    range from its first to its last item (``"(1x1),...,(6x6)"``: a in 1..6 (outer), b in 1..6), each times
    ``unit`` pixels; a list of ``[w, h]`` pairs is taken as pixel sizes."""
    import re

    if isinstance(value, str) and "x" in value:
        items = re.findall(r"\((\d+)x(\d+)\)", value)
        if not items:
            raise ConfigError(f"{source}: cannot read image_grid_pinpoints {value!r}")
        (a0, b0), (a1, b1) = [tuple(map(int, t)) for t in (items[0], items[-1])]
        return tuple((a * unit, b * unit) for a in range(a0, a1 + 1) for b in range(b0, b1 + 1))
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"{source}: cannot read image_grid_pinpoints {value!r}") from None
    try:
        out = tuple((int(w), int(h)) for w, h in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: cannot read image_grid_pinpoints {value!r}") from None
    if not out or min(min(p) for p in out) <= 0:
        raise ConfigError(f"{source}: image_grid_pinpoints must be positive (width, height) pairs")
    return out


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """LLaDA-V's image side: the SigLIP tower, the ``mlp2x_gelu`` projector and the ``anyres_max`` splicing.

    ``n_layers`` counts the layers the tower runs: the HF SigLIP config's ``num_hidden_layers`` minus one (the
    official loader deletes the last layer; its features are that layer's input, without post-LayerNorm).
    ``image_size`` is 384 whatever the tower config says (the official processor hard-codes it,
    ``docs/differences.md``); ``grid_pinpoints`` are ``(width, height)`` pixel sizes; ``max_num_patches`` is
    the ``N`` of ``anyres_max_N``; ``model_max_length`` cuts a spliced prompt (``tokenizer_model_max_length``).
    """

    hidden_size: int = 1152
    n_layers: int = 26
    n_heads: int = 16
    intermediate_size: int = 4304
    layer_norm_eps: float = 1e-6
    image_size: int = 384
    patch_size: int = 14
    grid_pinpoints: tuple[tuple[int, int], ...] = tuple((384 * a, 384 * b) for a in range(1, 7) for b in range(1, 7))
    max_num_patches: int = 4
    model_max_length: int = 8192

    def __post_init__(self):
        for name in ("hidden_size", "n_layers", "n_heads", "intermediate_size", "image_size", "patch_size",
                     "max_num_patches", "model_max_length"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"vision config: {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.n_heads:
            raise ConfigError(f"vision config: hidden_size {self.hidden_size} is not divisible by n_heads {self.n_heads}")
        if self.patch_size > self.image_size:
            raise ConfigError(f"vision config: patch_size {self.patch_size} > image_size {self.image_size}")

    @property
    def patches_per_side(self) -> int:
        """Patches per crop side (27 for 384 px / 14: the convolution drops the last 6 pixels)."""
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    def param_shapes(self, d_model: int) -> dict[str, Any]:
        """The image side's parameter shapes for an LM of width ``d_model`` (:mod:`polestar_jax.models.vision`):
        ``vision`` (the tower; its ``blocks`` stacked over its layers), ``projector`` and ``image_newline``."""
        c, nv, f, side, d = self.hidden_size, self.n_layers, self.intermediate_size, self.patches_per_side, d_model
        blocks = {f"{k}_{x}": (nv, c) for k in ("ln1", "q", "k", "v", "o", "ln2") for x in "wb"}
        blocks.update({f"{k}_w": (nv, c, c) for k in "qkvo"})
        blocks.update(fc1_w=(nv, c, f), fc1_b=(nv, f), fc2_w=(nv, f, c), fc2_b=(nv, c))
        return {"image_newline": (d,), "projector": {"w1": (c, d), "b1": (d,), "w2": (d, d), "b2": (d,)},
                "vision": {"patch_w": (c, 3, self.patch_size, self.patch_size), "patch_b": (c,),
                           "pos_emb": (side * side, c), "post_ln_w": (c,), "post_ln_b": (c,), "blocks": blocks}}

    @classmethod
    def from_llava_dict(cls, d: dict, source: str = "config") -> "VisionConfig":
        """From a LLaDA-V ``config.json``: the tower's shapes from its ``vision_config`` (an HF SigLIP vision
        config; SigLIP-so400m's defaults when absent), the rest from the LLaVA keys."""
        import re

        tower = d.get("vision_config") or dict(_SIGLIP_DEFAULTS)
        if not isinstance(tower, dict):
            raise ConfigError(f"{source}: vision_config must be an object")
        tower = {**_SIGLIP_DEFAULTS, **tower}
        if tower["hidden_act"] != "gelu_pytorch_tanh":
            raise ConfigError(f"{source}: unsupported vision hidden_act={tower['hidden_act']!r} "
                              "(this implementation needs 'gelu_pytorch_tanh')")
        if int(d["mm_hidden_size"]) != int(tower["hidden_size"]):
            raise ConfigError(f"{source}: mm_hidden_size {d['mm_hidden_size']} differs from the vision tower's "
                              f"hidden_size {tower['hidden_size']} (give the tower's config as vision_config)")
        aspect = d.get("image_aspect_ratio", "anyres_max_4")
        m = re.fullmatch(r"anyres_max_(\d+)", str(aspect))
        if not m:
            raise ConfigError(f"{source}: unsupported image_aspect_ratio={aspect!r} (this implementation needs "
                              "'anyres_max_<n>')")
        size = 384  # the official processor's, whatever the tower config says
        return cls(hidden_size=int(tower["hidden_size"]), n_layers=int(tower["num_hidden_layers"]) - 1,
                   n_heads=int(tower["num_attention_heads"]), intermediate_size=int(tower["intermediate_size"]),
                   layer_norm_eps=float(tower["layer_norm_eps"]), image_size=size,
                   patch_size=int(tower["patch_size"]),
                   grid_pinpoints=parse_grid_pinpoints(d.get("image_grid_pinpoints", "(1x1),...,(6x6)"), size,
                                                       source),
                   max_num_patches=int(m.group(1)),
                   model_max_length=int(d.get("tokenizer_model_max_length") or 8192))

    def to_llava_dict(self) -> dict:
        """The LLaVA keys and ``vision_config`` this config was read from (:meth:`from_llava_dict`)."""
        return {
            "mm_hidden_size": self.hidden_size, "mm_projector_type": "mlp2x_gelu",
            "mm_patch_merge_type": "spatial_unpad", "image_aspect_ratio": f"anyres_max_{self.max_num_patches}",
            "image_grid_pinpoints": [list(p) for p in self.grid_pinpoints], "mm_use_im_start_end": False,
            "mm_use_im_patch_token": False, "tokenizer_model_max_length": self.model_max_length,
            "vision_config": {"hidden_size": self.hidden_size, "num_hidden_layers": self.n_layers + 1,
                              "num_attention_heads": self.n_heads, "intermediate_size": self.intermediate_size,
                              "layer_norm_eps": self.layer_norm_eps, "patch_size": self.patch_size,
                              "image_size": self.image_size, "hidden_act": "gelu_pytorch_tanh",
                              "model_type": "siglip_vision_model"},
        }


# LLaDA-MoE (``architectures`` ["LLaDAMoEModelLM"]; its ``model_type`` is "llada" as LLaDA-8B's): required
# keys (the remote config's defaults are sentinels, MOE_SPEC.md section 1) and the values this implementation runs
MOE_ARCHITECTURE = "LLaDAMoEModelLM"
_MOE_REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "num_experts",
                        "num_experts_per_tok", "expert_intermediate_size", "vocab_size", "rope_theta")
_MOE_REQUIRED_VALUES: dict[str, Any] = {
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "partial_rotary_factor": 1,
    "moe_router_enable_expert_bias": False}
#: The names of the diffusion mask token in a tokenizer's vocabulary: LLaDA-8B's, then LLaDA-MoE's (and Dream's)
MASK_TOKENS = ("<|mdm_mask|>", "<|mask|>")
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def _read_json_or_none(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # absent or unreadable: the tokenizer loader reports a broken file


def tokenizer_mask_id(folder: str) -> Optional[int]:
    """The mask token's id as the tokenizer files of model folder ``folder`` give it, read as JSON (the
    tokenizer itself is not built): the token is ``tokenizer_config.json``'s ``mask_token`` if it names one,
    else the first of :data:`MASK_TOKENS` found; its id comes from ``tokenizer_config.json``'s
    ``added_tokens_decoder``, else ``tokenizer.json``'s ``added_tokens`` or its model's vocabulary. None when
    the files or the token are absent (LLaDA-MoE: its config.json has no mask id, its tokenizer holds
    ``<|mask|>``)."""
    tok_cfg, tok = (_read_json_or_none(os.path.join(folder, f)) for f in _TOKENIZER_FILES)
    tok_cfg = tok_cfg if isinstance(tok_cfg, dict) else {}
    named = tok_cfg.get("mask_token")
    named = named.get("content") if isinstance(named, dict) else named
    wanted = (named,) if isinstance(named, str) else MASK_TOKENS
    ids: dict[str, int] = {}
    decoder = tok_cfg.get("added_tokens_decoder")
    for key, entry in decoder.items() if isinstance(decoder, dict) else ():
        if isinstance(entry, dict) and isinstance(entry.get("content"), str) and str(key).isdigit():
            ids.setdefault(entry["content"], int(key))
    if not any(t in ids for t in wanted) and isinstance(tok, dict):
        for entry in tok.get("added_tokens") or ():
            if isinstance(entry, dict) and isinstance(entry.get("id"), int):
                ids.setdefault(str(entry.get("content")), entry["id"])
        vocab = (tok.get("model") or {}).get("vocab") if isinstance(tok.get("model"), dict) else None
        for t in wanted:
            if isinstance(vocab, dict) and isinstance(vocab.get(t), int):
                ids.setdefault(t, vocab[t])
    return next((ids[t] for t in wanted if t in ids), None)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts part of a LLaDA-MoE :class:`ModelConfig` (``family`` "llada_moe"); each expert
    is a SwiGLU MLP of ``ModelConfig.mlp_hidden_size`` (``expert_intermediate_size``).

    ``norm_topk_prob`` is recorded as the config says it but never used: the reference hard-codes no
    renormalisation of the top-k routing weights (``docs/differences.md``)."""

    n_experts: int  # num_experts
    top_k: int  # num_experts_per_tok
    qk_norm: bool = True  # qk_layernorm: per-head RMSNorm of q and k (weight [hd]) before RoPE
    norm_topk_prob: bool = False  # as config.json says; ignored, as by the reference

    def __post_init__(self):
        if self.n_experts < 1:
            raise ConfigError(f"MoeConfig: num_experts must be positive, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"MoeConfig: num_experts_per_tok {self.top_k} outside 1..{self.n_experts}")


def _llada_moe_config(d: dict, source: str, generation: Optional[dict], folder: Optional[str]) -> "ModelConfig":
    """A LLaDA-MoE ``config.json`` (HF Llama/OLMoE-style keys): every key read from the file, anything
    the reference would run differently (a shared expert, dense layers, an expert bias, partial RoPE,
    q/k/v clipping, RoPE scaling) refused. The mask id: ``mask_token_id`` of config.json, else of
    ``generation_config.json``, else the tokenizer's mask token in ``folder`` (:func:`tokenizer_mask_id`: the
    real checkpoint's ``<|mask|>``); none of them is a one-line error (no id is assumed)."""
    _check_fields(d, source, _MOE_REQUIRED_FIELDS, _MOE_REQUIRED_VALUES)
    for key in ("shared_expert_intermediate_size", "clip_qkv", "rope_scaling"):
        if d.get(key) is not None:
            raise ConfigError(f"{source}: unsupported {key}={d[key]!r} (this implementation needs null)")
    if d["rope_theta"] is None or float(d["rope_theta"]) <= 0:  # (the remote config's default is -1)
        raise ConfigError(f"{source}: rope_theta must be positive, got {d['rope_theta']!r}")
    n_layers = int(d["num_hidden_layers"])
    freq = d.get("moe_layer_freq")
    if freq is not None and list(freq) != [1] * n_layers:
        raise ConfigError(f"{source}: unsupported moe_layer_freq={freq!r} (every layer must be MoE)")
    vocab = int(d["vocab_size"])
    mask = d.get("mask_token_id", (generation or {}).get("mask_token_id"))
    if mask is None and folder is not None:
        mask = tokenizer_mask_id(folder)
    if mask is None:
        raise ConfigError(f"{source}: no mask_token_id (config.json and generation_config.json name none, and no "
                          f"tokenizer file beside it holds {' or '.join(MASK_TOKENS[1:])}): add \"mask_token_id\" "
                          "to config.json")
    pad = d.get("pad_token_id", d.get("eos_token_id"))
    eos = d.get("eos_token_id", pad)
    if eos is None:
        raise ConfigError(f"{source}: missing field(s) eos_token_id")
    n_heads = int(d["num_attention_heads"])
    moe = MoeConfig(n_experts=int(d["num_experts"]), top_k=int(d["num_experts_per_tok"]),
                    qk_norm=bool(d.get("qk_layernorm", False)), norm_topk_prob=bool(d.get("norm_topk_prob")))
    return ModelConfig.named(
        source, d_model=int(d["hidden_size"]), n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads") or n_heads), n_layers=n_layers,
        mlp_hidden_size=int(d["expert_intermediate_size"]), vocab_size=vocab, embedding_size=vocab,
        mask_token_id=int(mask), eos_token_id=int(eos), pad_token_id=int(eos if pad is None else pad),
        max_sequence_length=int(d.get("max_position_embeddings") or 8192), rope_theta=float(d["rope_theta"]),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)), family="llada_moe", moe=moe)


def _llada_moe_hf_dict(cfg: "ModelConfig") -> dict:
    """The LLaDA-MoE ``config.json`` keys of ``cfg`` (:meth:`ModelConfig.to_hf_dict`)."""
    n = cfg.n_layers
    return {
        "architectures": [MOE_ARCHITECTURE], "model_type": "llada", "hidden_act": "silu",
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "num_hidden_layers": n, "num_experts": cfg.moe.n_experts, "num_experts_per_tok": cfg.moe.top_k,
        "expert_intermediate_size": cfg.mlp_hidden_size, "moe_layer_freq": [1] * n,
        "shared_expert_intermediate_size": None, "moe_router_enable_expert_bias": False,
        "qk_layernorm": cfg.moe.qk_norm, "norm_topk_prob": cfg.moe.norm_topk_prob, "vocab_size": cfg.vocab_size,
        "mask_token_id": cfg.mask_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "max_position_embeddings": cfg.max_sequence_length, "rope_theta": cfg.rope_theta,
        "partial_rotary_factor": 1, "rope_scaling": None, "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": False, "clip_qkv": None, "tie_word_embeddings": False,
    }


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and ids of a model of either family: LLaDA (``block_type=llama``) or Dream (Qwen2 layout);
    ``family`` names it (:data:`polestar_jax.models.family.FAMILIES`).

    Attribute names follow the HF ``config.json`` of LLaDA-8B-Instruct; :meth:`from_dict` maps a Dream
    ``config.json`` onto them (``hidden_size`` -> ``d_model``, ``num_attention_heads`` -> ``n_heads``, ...,
    ``include_qkv_bias=True``). ``embedding_size`` is the number of rows of the embedding and LM-head
    matrices (>= ``vocab_size``).
    """

    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    mlp_hidden_size: int
    vocab_size: int
    embedding_size: int
    mask_token_id: int
    eos_token_id: int
    pad_token_id: int
    max_sequence_length: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    include_qkv_bias: bool = False
    family: str = "llada"  # the model family (polestar_jax.models.family.FAMILIES)
    vision: Optional[VisionConfig] = None  # LLaDA-V's tower / projector / splicing (family llada_v only)
    moe: Optional[MoeConfig] = None  # LLaDA-MoE's experts (family llada_moe only; mlp_hidden_size: per expert)

    def __post_init__(self):
        self.validate("ModelConfig")

    @classmethod
    def named(cls, source: str, **fields: Any) -> "ModelConfig":
        """``ModelConfig(**fields)`` whose failed checks name ``source`` (the file read) instead of the class:
        ``config.json: d_model 10 is not divisible by n_heads 3``."""
        try:
            return cls(**fields)
        except ConfigError as e:
            raise ConfigError(f"{source}: {str(e).partition(': ')[2] or e}") from None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_dict(cls, d: dict, source: str = "config", generation: Optional[dict] = None,
                  folder: Optional[str] = None) -> "ModelConfig":
        """Builds a config from a parsed HF ``config.json``; raises :class:`ConfigError` on anything we
        cannot run (another architecture, missing fields, inconsistent shapes). The family comes from
        ``model_type`` (``llada`` or ``Dream``); ``generation`` (a parsed ``generation_config.json``) supplies
        ids the config lacks (Dream's eos); ``folder`` (the model folder) lets LLaDA-MoE read its mask id from
        the tokenizer files there (:func:`tokenizer_mask_id`)."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        if MOE_ARCHITECTURE in (d.get("architectures") or ()):  # model_type "llada", as LLaDA-8B's
            return _llada_moe_config(d, source, generation, folder)
        model_type = d.get("model_type", "llada")
        if model_type not in _MODEL_TYPES:
            raise ConfigError(f"{source}: unsupported model_type {model_type!r} (supported: "
                              f"{', '.join(map(repr, _MODEL_TYPES))})")
        if _MODEL_TYPES[model_type] == "dream":
            return cls._from_dream_dict(d, source, generation)
        if _MODEL_TYPES[model_type] == "llada_v":
            return cls._from_llava_dict(d, source)
        _check_fields(d, source, _REQUIRED_FIELDS, _REQUIRED_VALUES)
        if d.get("include_qkv_bias"):
            raise ConfigError(f"{source}: unsupported include_qkv_bias=True")
        n_heads = int(d["n_heads"])
        n_kv = d.get("n_kv_heads") or n_heads
        if d.get("multi_query_attention"):
            n_kv = 1
        vocab = int(d["vocab_size"])
        emb = int(d.get("embedding_size") or vocab)
        cfg = cls.named(source,
            d_model=int(d["d_model"]),
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            n_layers=int(d["n_layers"]),
            mlp_hidden_size=int(d["mlp_hidden_size"]),
            vocab_size=vocab,
            embedding_size=emb,
            mask_token_id=int(d["mask_token_id"]),
            eos_token_id=int(d.get("eos_token_id", d.get("pad_token_id", 0))),
            pad_token_id=int(d.get("pad_token_id", d.get("eos_token_id", 0))),
            max_sequence_length=int(d.get("max_sequence_length", 4096)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        )
        return cfg

    @classmethod
    def from_json(cls, path: str) -> "ModelConfig":
        """Reads ``path`` (a ``config.json`` or a folder holding one), with the ``generation_config.json`` and
        (LLaDA-MoE's mask id) the tokenizer files beside it."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        try:
            with open(path) as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        tower = d.get("mm_vision_tower") if isinstance(d, dict) and d.get("model_type") == "llava_llada" else None
        tower = os.path.join(os.path.dirname(path), tower, "config.json") if isinstance(tower, str) and tower else ""
        if tower and "vision_config" not in d and os.path.isfile(tower):
            # LLaDA-V: the tower's shapes come from the SigLIP folder its config names (as the official loader)
            try:
                with open(tower) as f:
                    d = {**d, "vision_config": json.load(f)}
            except (OSError, ValueError) as e:
                raise ConfigError(f"{tower}: not valid JSON ({e})") from None
        generation = None
        gen_path = os.path.join(os.path.dirname(path), "generation_config.json")
        if os.path.isfile(gen_path):
            try:
                with open(gen_path) as f:
                    generation = json.load(f)
            except (OSError, ValueError):
                generation = None  # optional; checkpoint.generation_defaults reports a broken file
        return cls.from_dict(d, source=path, generation=generation if isinstance(generation, dict) else None,
                             folder=os.path.dirname(path))

    @classmethod
    def _from_dream_dict(cls, d: dict, source: str, generation: Optional[dict]) -> "ModelConfig":
        """A Dream (Qwen2-layout) ``config.json``: q/k/v biases, GQA, untied head. Ids as the official
        sampler takes them: the mask id from ``config.json`` (DreamConfig's default 151666 when absent),
        pad from the config (default 151643), eos from the config, else ``generation_config.json``,
        else pad (``docs/differences.md#d25``)."""
        _check_fields(d, source, _DREAM_REQUIRED_FIELDS, _DREAM_REQUIRED_VALUES)
        if d.get("rope_scaling"):
            raise ConfigError(f"{source}: unsupported rope_scaling={d['rope_scaling']!r} (plain RoPE only)")

        def one_id(v):
            return int(v[0]) if isinstance(v, (list, tuple)) and v else (None if v is None else int(v))

        pad = one_id(d.get("pad_token_id"))
        pad = 151643 if pad is None else pad
        eos = one_id(d.get("eos_token_id"))
        if eos is None and generation:
            eos = one_id(generation.get("eos_token_id"))
        mask = one_id(d.get("mask_token_id"))
        n_heads = int(d["num_attention_heads"])
        vocab = int(d["vocab_size"])
        cfg = cls.named(source,
            d_model=int(d["hidden_size"]), n_heads=n_heads,
            n_kv_heads=int(d.get("num_key_value_heads") or n_heads), n_layers=int(d["num_hidden_layers"]),
            mlp_hidden_size=int(d["intermediate_size"]), vocab_size=vocab, embedding_size=vocab,
            mask_token_id=151666 if mask is None else mask, eos_token_id=pad if eos is None else eos,
            pad_token_id=pad, max_sequence_length=int(d.get("max_position_embeddings") or 32768),
            rope_theta=float(d.get("rope_theta", 10000.0)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            include_qkv_bias=True, family="dream")
        return cfg

    @classmethod
    def _from_llava_dict(cls, d: dict, source: str) -> "ModelConfig":
        """A LLaDA-V (``llava_llada``) ``config.json``: the LM in the Llama layout (LLaDA-8B's shapes and
        ids; the mask id 126336 when absent, as the official sampler hard-codes it) and the image side
        (:meth:`VisionConfig.from_llava_dict`)."""
        _check_fields(d, source, _LLAVA_REQUIRED_FIELDS, _LLAVA_REQUIRED_VALUES)
        if d.get("rope_scaling"):
            raise ConfigError(f"{source}: unsupported rope_scaling={d['rope_scaling']!r} (plain RoPE only)")
        n_heads, vocab = int(d["num_attention_heads"]), int(d["vocab_size"])
        eos = d.get("eos_token_id", 126081)
        cfg = cls(
            d_model=int(d["hidden_size"]), n_heads=n_heads,
            n_kv_heads=int(d.get("num_key_value_heads") or n_heads), n_layers=int(d["num_hidden_layers"]),
            mlp_hidden_size=int(d["intermediate_size"]), vocab_size=vocab, embedding_size=vocab,
            mask_token_id=int(d.get("mask_token_id") or 126336), eos_token_id=int(eos),
            pad_token_id=int(d.get("pad_token_id", eos)),
            max_sequence_length=int(d.get("max_position_embeddings") or 8192),
            rope_theta=float(d.get("rope_theta", 500000.0)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            family="llada_v", vision=VisionConfig.from_llava_dict(d, source))
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        if (self.family == "llada_v") != (self.vision is not None):
            raise ConfigError(f"{source}: a vision config goes with family 'llada_v' (and only with it)")
        if (self.family == "llada_moe") != (self.moe is not None):
            raise ConfigError(f"{source}: a MoE config goes with family 'llada_moe' (and only with it)")
        for name in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{source}: {name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"{source}: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{source}: head dim {self.head_dim} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"{source}: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.embedding_size < self.vocab_size:
            raise ConfigError(f"{source}: embedding_size {self.embedding_size} < vocab_size {self.vocab_size}")
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, name) < self.embedding_size:
                raise ConfigError(f"{source}: {name} {getattr(self, name)} outside the embedding")
        if self.max_sequence_length <= 0:
            raise ConfigError(f"{source}: max_sequence_length must be positive, got {self.max_sequence_length}")

    def _llama_layout_dict(self, architecture: str, model_type: str) -> dict:
        """The HF config fields of a Llama-layout model (Dream's Qwen2, LLaDA-V's LM)."""
        return {
            "architectures": [architecture], "model_type": model_type, "hidden_act": "silu",
            "hidden_size": self.d_model, "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads, "num_hidden_layers": self.n_layers,
            "intermediate_size": self.mlp_hidden_size, "vocab_size": self.vocab_size,
            "mask_token_id": self.mask_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "max_position_embeddings": self.max_sequence_length,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps, "rope_scaling": None,
            "tie_word_embeddings": False,
        }

    def to_hf_dict(self) -> dict:
        """The HF ``config.json`` fields this config was read from (enough to load it again)."""
        if self.family == "llada_moe":
            return _llada_moe_hf_dict(self)
        if self.family == "llada_v":
            return {**self._llama_layout_dict("LlavaLLaDAModelLM", "llava_llada"), "attention_bias": False,
                    **self.vision.to_llava_dict()}
        if self.family == "dream":
            return self._llama_layout_dict("DreamModel", "Dream")
        return {
            "architectures": ["LLaDAModelLM"], "model_type": "llada",
            "activation_type": "silu", "alibi": False, "attention_layer_norm": False, "block_group_size": 1,
            "block_type": "llama", "d_model": self.d_model, "embedding_size": self.embedding_size,
            "eos_token_id": self.eos_token_id, "include_bias": False, "include_qkv_bias": False,
            "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
            "mask_token_id": self.mask_token_id, "max_sequence_length": self.max_sequence_length,
            "mlp_hidden_size": self.mlp_hidden_size, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
            "n_layers": self.n_layers, "pad_token_id": self.pad_token_id, "rms_norm_eps": self.rms_norm_eps,
            "rope": True, "rope_full_precision": True, "rope_theta": self.rope_theta, "scale_logits": False,
            "vocab_size": self.vocab_size, "weight_tying": False,
        }


class Mode(str, enum.Enum):
    """A configuration mode: a string enum (``Decoder("polestar") == "polestar"``) whose member names are
    its values, so it hashes, prints and serialises as the plain string. Configs accept either form and
    store the enum (:func:`as_mode`)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class Decoder(Mode):
    llada = "llada"
    fastdllm = "fastdllm"
    polestar = "polestar"
    polestar_v = "polestar_v"


class Cache(Mode):
    none = "none"
    prefix = "prefix"
    dual = "dual"


class Remasking(Mode):
    low_confidence = "low_confidence"
    random = "random"


class Kernels(Mode):
    auto = "auto"
    pallas = "pallas"
    interpret = "interpret"
    reference = "reference"


class ProxyScore(Mode):
    heads = "heads"
    mean = "mean"


class PatchKV(Mode):
    packet = "packet"
    clustered = "clustered"


class TieBreak(Mode):
    lowest = "lowest"
    shared_row = "shared_row"


class StartCommit(Mode):
    rule = "rule"
    first = "first"


class Schedule(Mode):
    even = "even"
    timesteps = "timesteps"


class RankBy(Mode):
    confidence = "confidence"
    neg_entropy = "neg_entropy"


class OffloadHidden(Mode):
    none = "none"
    int8 = "int8"
    bf16 = "bf16"


class KVCache(Mode):
    """How the K/V cache stores keys and values (:attr:`DecodeConfig.kv_cache`)."""

    float = "float"
    int8 = "int8"


def as_mode(cls: type[Mode], value: Any, what: str) -> Mode:
    """``value`` as a member of ``cls``; a one-line :class:`ConfigError` naming ``what`` otherwise."""
    try:
        return cls(value)
    except ValueError:
        raise ConfigError(f"unknown {what} {value!r} (choose from {', '.join(cls.choices())})") from None


Rule = Literal["fixed", "threshold", "factor"]

DECODERS = Decoder.choices()
#: The decoders that read a :class:`PolestarConfig` (the LLaDA path's Polestar and LLaDA-V's).
POLESTAR_DECODERS = ("polestar", "polestar_v")
CACHES = Cache.choices()
#: K/V cache storage modes (:attr:`DecodeConfig.kv_cache`; :mod:`polestar_jax.models.kv_quant`).
KV_CACHES = KVCache.choices()
#: The decoders whose K/V cache may be stored as int8 (``kv_cache="int8"``).
KV_INT8_DECODERS = ("fastdllm", "polestar", "polestar_v")
REMASKING = Remasking.choices()


def knob(default, help: str, flag: Optional[str] = None, aliases: tuple[str, ...] = (), **extra):
    """A config field that is also a command-line flag: ``help`` is its one-line description (the CLI adds
    the default), ``flag`` its name (default: ``--field-name``), ``aliases`` documented other spellings;
    ``extra`` may hold ``choices``, ``cli_default`` (the CLI's default where it differs from the API's),
    ``negate`` (a bool field's ``--no-...`` flag) and ``none`` (the string 'none' means None)."""
    meta = {"help": help, "flag": flag, "aliases": tuple(aliases), **extra}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


#: The server's default wait for returning clients after rows finish, as a fraction of the last block call
#: (:class:`polestar_jax.serving.scheduler.Scheduler`'s ``batch_wait``): at most this share of a block call, only
#: after a block in which rows finished.
BATCH_WAIT = 0.1
#: Drift/refresh kernel implementations (:attr:`PolestarConfig.kernels`).
KERNELS = Kernels.choices()
#: Storage modes of Polestar's hidden-state store (:attr:`PolestarConfig.offload_hidden`).
OFFLOAD_HIDDEN = OffloadHidden.choices()


#: Platform names of GPU programs (``jax.Device.platform``, ``jax.default_backend()``): what the engine
#: compiles differently for a GPU (its XLA options, one refresh width, no row chunks) keys on these.
GPU_PLATFORMS = ("gpu", "cuda", "rocm")

#: Compiled refresh sizes per stage when ``PolestarConfig.refresh_buckets`` is none (1 on a GPU:
#: :meth:`PolestarConfig.for_platform`).
REFRESH_BUCKETS = 4


@dataclasses.dataclass(frozen=True)
class PolestarConfig:
    """The knobs of Polestar-Cache and Polestar-Commit; defaults equal the official PyTorch code.

    Each field's ``help`` (see :func:`knob`) says what it does; ``python -m polestar_jax.generate --help``
    prints the same text with the default. Settings that could not do what they say (a refresh of no
    cluster, more clusters than window rows, an early-commit band that is empty) raise :class:`ConfigError`;
    the checks that need the block length are in :meth:`DecodeConfig.validate`.
    """

    n_clusters: int = knob(8, "k-means clusters per layer, split between the prefix and suffix windows "
                              "(prefix: min(n-1, max(1, n*pre_rows // (pre_rows+suf_rows))))",
                           flag="--clusters", aliases=("--n-clusters",))
    prefix_blocks: int = knob(2, "prefix window = this many block lengths before the block")
    suffix_blocks: int = knob(1, "suffix window = this many block lengths after the block")
    kmeans_iters: int = knob(5, "k-means iterations (cosine assignment, raw-mean centroids)")
    refresh: bool = knob(True, "Polestar-Cache: decode steps refresh the top-drift clusters of the window "
                               "(off: the cached window is only recomputed at block starts)", negate="--no-refresh")
    top_k: int = knob(4, "clusters refreshed per layer by a refresh step")
    top_k_last: int = knob(1, "clusters refreshed at the last layer (their suffix rows feed the suffix commit)")
    windowed_period: int = knob(4, "every n-th block (b % n == n-1) starts with a pass over the window only "
                                   "instead of a full pass (0: always a full pass)")
    trigger_commits: int = knob(1, "a decode step refreshes when the previous step committed more than this "
                                   "many tokens")
    trigger_accum: int = knob(2, "... or when the commits since the last refresh exceed this")
    history: int = knob(5, "token-drift history length (delta = drift - mean of the history)")
    early_threshold: Optional[float] = knob(
        0.7, "Polestar-Commit: tokens with early_threshold < conf < threshold whose drift delta passes the "
             "gate commit early ('none': off)", none=True)
    gate_center: float = knob(0.9, "early-commit gate: gate = gate_scale * max(0, gate_center - conf)^2 <= delta")
    gate_scale: float = knob(10.0, "early-commit gate scale (see --gate-center)")
    gate_max_delta: float = knob(2.0, "early commit needs delta < this")
    suffix_precommit: bool = knob(True, "refreshed suffix rows (the last layer's top cluster) whose prediction "
                                        "has confidence >= threshold commit ahead of their block",
                                  negate="--no-suffix-commit")
    kernels: Kernels = knob("auto", "drift/refresh kernels: auto = Pallas on GPU/TPU and the jnp reference on "
                                "CPU; pallas; interpret (Pallas interpreter, slow: for tests); reference",
                        choices=KERNELS)
    offload_hidden: OffloadHidden = knob("none", "where the refresh rows' stored hidden states live: none = exact, in "
                                       "device memory; int8 (one float32 scale per row) or bf16 = in host "
                                       "memory (pinned_host); a refresh moves only the rows it reads",
                               choices=OFFLOAD_HIDDEN)
    full_prefix_rows: Optional[int] = knob(None, "rows before the block clustered by a full-pass block start "
                                                 "(default: prefix_blocks x block length; Dream's official code: 64)")
    full_suffix_rows: Optional[int] = knob(None, "rows after the block clustered by a full-pass block start "
                                                 "(default: suffix_blocks x block length; Dream's official code: 32)")
    proxy_score: ProxyScore = knob("heads", "cluster drift: heads = per-head proxy attention, KL averaged over heads "
                                     "(LLaDA); mean = queries averaged over heads and keys over KV heads, one "
                                     "softmax (Dream)", choices=ProxyScore.choices())
    patch_kv: PatchKV = knob("packet", "refresh K/V patch rows: packet = every row the previous layer recomputed "
                                   "(LLaDA); clustered = only those clustered at this layer, as the hidden-state "
                                   "patch (Dream)", choices=PatchKV.choices())
    tie_break: TieBreak = knob("lowest", "equal block confidences: lowest = the lower position ranks first; "
                                    "shared_row = as lowest, except that of the two positions that share the "
                                    "span's first logits row (a shifted family's block-only forward) the later "
                                    "one ranks first (the official Dream code's choice)",
                          choices=TieBreak.choices())
    refresh_buckets: Optional[int] = knob(None, "a refresh computes (and, from a host store, moves) only the rows "
                                   "it selects, rounded up to one of this many compiled sizes (more: less work per "
                                   "refresh, longer compile; 1: always every window row); tokens never depend on it. "
                                   f"none: {REFRESH_BUCKETS}, or 1 in a program compiled for a GPU (a GPU step is "
                                   "bound by its weight reads, and each size's branch would copy the layer's weights)")

    def __post_init__(self):
        object.__setattr__(self, "kernels", as_mode(Kernels, self.kernels, "Polestar kernels"))
        for name, cls in (("offload_hidden", OffloadHidden), ("proxy_score", ProxyScore), ("patch_kv", PatchKV),
                          ("tie_break", TieBreak)):
            object.__setattr__(self, name, as_mode(cls, getattr(self, name), name))
        self.validate()

    def for_platform(self, platform: Optional[str]) -> "PolestarConfig":
        """This config with ``refresh_buckets`` none made concrete for programs compiled for ``platform``
        (``jax.Device.platform``; None: the default, :data:`REFRESH_BUCKETS`): 1 on a GPU, where a refresh
        step reads every weight whatever rows it computes and each size's branch would copy them."""
        if self.refresh_buckets is not None:
            return self
        return dataclasses.replace(self, refresh_buckets=1 if platform in GPU_PLATFORMS else REFRESH_BUCKETS)

    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(f"invalid Polestar setting: {msg}")

        need(self.refresh_buckets is None or isinstance(self.refresh_buckets, int) and self.refresh_buckets >= 1,
             f"refresh_buckets must be an integer >= 1 or none, got {self.refresh_buckets!r}")
        need(self.n_clusters >= 2, f"n_clusters must be >= 2, got {self.n_clusters}")
        need(self.prefix_blocks >= 1, f"prefix_blocks must be >= 1, got {self.prefix_blocks}")
        need(self.suffix_blocks >= 0, f"suffix_blocks must be >= 0, got {self.suffix_blocks}")
        need(self.kmeans_iters >= 1, f"kmeans_iters must be >= 1, got {self.kmeans_iters}")
        need(self.top_k >= 1, f"top_k must be >= 1, got {self.top_k} (to switch the refresh off use "
                              "refresh=False, --no-refresh)")
        need(self.top_k_last >= 0, f"top_k_last must be >= 0, got {self.top_k_last}")
        need(self.top_k <= self.n_clusters,
             f"top_k {self.top_k} is larger than the number of clusters {self.n_clusters}")
        need(self.top_k_last <= self.n_clusters,
             f"top_k_last {self.top_k_last} is larger than the number of clusters {self.n_clusters}")
        need(self.windowed_period == 0 or self.windowed_period >= 2,
             f"windowed_period must be 0 (never) or >= 2, got {self.windowed_period}")
        need(self.trigger_commits >= 0 and self.trigger_accum >= 0, "refresh triggers must be >= 0")
        need(self.history >= 1, f"history must be >= 1, got {self.history}")
        need(self.early_threshold is None or 0.0 <= self.early_threshold < 1.0,
             f"early_threshold must be in [0, 1) or None, got {self.early_threshold}")
        need(self.gate_scale >= 0, f"gate_scale must be >= 0, got {self.gate_scale}")
        need(self.gate_max_delta > 0, f"gate_max_delta must be > 0 (else early commit never fires), "
                                      f"got {self.gate_max_delta}")
        for name in ("full_prefix_rows", "full_suffix_rows"):
            v = getattr(self, name)
            need(v is None or (isinstance(v, int) and v >= 0), f"{name} must be None or an integer >= 0, got {v!r}")
        need(self.full_prefix_rows is None or self.full_prefix_rows >= 1,
             "full_prefix_rows must be >= 1 (the prefix window is never empty by design)")
        if self.suffix_precommit:
            need(self.refresh, "suffix_precommit commits refreshed suffix rows, so it needs refresh=True "
                               "(or turn it off: --no-suffix-commit)")
            need(self.suffix_blocks >= 1, "suffix_precommit needs a suffix window (suffix_blocks >= 1)")
            need(self.top_k_last >= 1, "suffix_precommit needs top_k_last >= 1 (it commits the last layer's "
                                       "refreshed suffix rows)")

    def window_rows(self, block_length: int) -> int:
        """Rows of the refresh window (prefix + suffix) for blocks of ``block_length``: the rows the store
        holds (the larger of the full-pass and the windowed-pass windows on each side)."""
        return self.prefix_rows(block_length) + self.suffix_rows(block_length)

    def pass_window(self, block_length: int, windowed: bool) -> tuple[int, int]:
        """(rows before, rows after) the block that a block start clusters: the windowed pass
        ``prefix_blocks`` / ``suffix_blocks`` block lengths; a full pass ``full_prefix_rows`` /
        ``full_suffix_rows`` when set, else the same."""
        pre, suf = self.prefix_blocks * block_length, self.suffix_blocks * block_length
        if windowed:
            return pre, suf
        return (pre if self.full_prefix_rows is None else self.full_prefix_rows,
                suf if self.full_suffix_rows is None else self.full_suffix_rows)

    def prefix_rows(self, block_length: int) -> int:
        """Prefix rows of the store (the larger of the two block starts' prefix windows)."""
        return max(self.pass_window(block_length, False)[0], self.pass_window(block_length, True)[0])

    def suffix_rows(self, block_length: int) -> int:
        """Suffix rows of the store (the larger of the two block starts' suffix windows)."""
        return max(self.pass_window(block_length, False)[1], self.pass_window(block_length, True)[1])


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How to decode: the sampler configuration shared by all decoders.

    * ``decoder="llada"``: LLaDA's sampler: ``steps // num_blocks`` forwards per block, a fixed number of
      tokens committed per forward, no cache (``cache`` must be ``"none"``, no ``threshold``/``factor``).
    * ``decoder="polestar"``: Fast-dLLM's dual cache and threshold rule plus Polestar-Cache (drift-guided
      sparse refresh) and Polestar-Commit (early and suffix commits); knobs in ``polestar``.
    * ``decoder="fastdllm"``: Fast-dLLM's sampler: ``threshold`` (commit every candidate with
      confidence >= threshold, the most confident always), ``factor`` (Fast-dLLM's dynamic rule) or, with
      neither, the fixed schedule; ``cache`` ``none`` / ``prefix`` / ``dual``.
    * ``decoder="polestar_v"``: the official LLaDA-V code's Polestar: Fast-dLLM's prefix cache and threshold
      rule, one k-means over the final hidden states of the prompt and a window, refreshes from the smallest
      selected position, early commits gated by the block's cosine drift (``cache="prefix"``; knobs: the
      ``polestar`` fields it shares with the LLaDA path's, :mod:`polestar_jax.decode.polestar_v`).
    """

    decoder: Decoder = knob("polestar", "llada (fixed tokens per forward), fastdllm (threshold/factor rules, "
                                    "caches), polestar (dual cache + Polestar-Cache/Commit) or polestar_v "
                                    "(LLaDA-V's official Polestar: prefix cache, one k-means over final hidden "
                                    "states)",
                        choices=DECODERS)
    cache: Cache = knob("dual", "KV cache: none, prefix or dual (llada: none only; polestar: dual only; "
                                "polestar_v: prefix only)",
                      choices=CACHES, cli_default=None)
    kv_cache: KVCache = knob("float", "K/V cache storage: float (the model's dtype) or int8 (one scale per cached "
                                      "row and KV head: half the bytes of bfloat16; decoder fastdllm with "
                                      "--cache prefix or dual, polestar and polestar_v; "
                                      "docs/scaling.md#int8-kv-cache)",
                             choices=KV_CACHES)
    gen_length: int = knob(128, "tokens to generate", cli_default=None)
    block_length: int = knob(32, "tokens per block (decoded left to right)", cli_default=None)
    steps: Optional[int] = knob(None, "forwards of the fixed schedule over the whole generation (llada, or "
                                      "fastdllm with --threshold none; default: gen length)")
    threshold: Optional[float] = knob(0.9, "confidence threshold (fastdllm and polestar): each forward commits "
                                           "its most confident token and every token with conf >= threshold "
                                           "('none': the fixed schedule)", none=True)
    factor: Optional[float] = knob(None, "Fast-dLLM's dynamic factor rule instead of a threshold (fastdllm)")
    temperature: float = knob(0.0, "Gumbel-max sampling temperature (0: argmax); keyed by --seed and the row")
    remasking: Remasking = knob("low_confidence", "which tokens commit first: low_confidence (the most confident) or "
                                            "random (random confidences; not for polestar)", choices=REMASKING)
    early_exit: bool = knob(True, "stop decoding a row after the first finished block that holds a stop token "
                                  "(EOS, end of turn): the response is the same, the blocks after it cost no "
                                  "forwards (off: every block is decoded, as the reference code does)",
                            negate="--no-early-exit")
    # Fast-dLLM (prefix/dual cache) runs its step loop at least once after the block's full forward, even
    # when that forward filled the block; Polestar's port of the same loop checks for masks first.
    step_after_full_pass: bool = True
    # What the start forward of the cached variants commits: "rule" (Fast-dLLM: the commit rule over the
    # block) or "first" (Dream's dual-cache loop: only the block's first position, unconditionally).
    start_commit: StartCommit = StartCommit.rule
    # The fixed rule (threshold=None, factor=None): its schedule, "even" (LLaDA's get_num_transfer_tokens) or
    # "timesteps" (Dream: int(n * (1 - s/t)) of the n masks left, t, s consecutive points of
    # linspace(1, schedule_eps, steps_per_block + 1); all of them from the last step of the block on), and its
    # ranking, "confidence" or "neg_entropy" (sum p log(p + 1e-10), Dream's alg="entropy").
    schedule: Schedule = Schedule.even
    rank_by: RankBy = RankBy.confidence
    schedule_eps: float = 1e-3
    polestar: PolestarConfig = dataclasses.field(default_factory=PolestarConfig)

    def __post_init__(self):
        if self.steps is None:
            object.__setattr__(self, "steps", self.gen_length)
        for name, cls in (("decoder", Decoder), ("cache", Cache), ("kv_cache", KVCache), ("remasking", Remasking),
                          ("start_commit", StartCommit), ("schedule", Schedule), ("rank_by", RankBy)):
            object.__setattr__(self, name, as_mode(cls, getattr(self, name), name))
        self.validate()

    @property
    def rule(self) -> Rule:
        if self.factor is not None:
            return "factor"
        if self.threshold is not None:
            return "threshold"
        return "fixed"

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    def validate(self) -> None:
        if self.gen_length <= 0 or self.block_length <= 0:
            raise ConfigError("gen length and block length must be positive")
        if self.gen_length % self.block_length:
            raise ConfigError(f"gen length {self.gen_length} is not a multiple of block length {self.block_length}")
        if self.steps <= 0 or self.steps % self.num_blocks:
            raise ConfigError(f"steps {self.steps} is not a positive multiple of the number of blocks {self.num_blocks}")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.factor is not None and self.threshold is not None:
            raise ConfigError("give either a threshold or a factor rule, not both (threshold=None with factor)")
        if self.factor is not None and not self.factor > 0:
            raise ConfigError(f"factor must be positive, got {self.factor}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if (self.schedule != "even" or self.rank_by != "confidence") and (self.rule != "fixed"
                                                                            or self.decoder != "fastdllm"):
            raise ConfigError("schedule / rank_by apply to decoder 'fastdllm' with the fixed rule (threshold none)")
        if self.start_commit != "rule" and (self.decoder != "fastdllm" or self.cache == "none"):
            raise ConfigError("start_commit 'first' applies to decoder 'fastdllm' with a cache (prefix or dual)")
        if not 0.0 < self.schedule_eps < 1.0:
            raise ConfigError(f"schedule_eps must be in (0, 1), got {self.schedule_eps}")
        if self.decoder not in POLESTAR_DECODERS and self.polestar != PolestarConfig():
            raise ConfigError(f"Polestar settings apply to decoder 'polestar' only, or 'polestar_v' (decoder is "
                              f"{self.decoder!r})")
        if self.kv_cache != "float" and (self.decoder not in KV_INT8_DECODERS or self.cache == "none"):
            raise ConfigError(f"kv_cache {self.kv_cache} applies to decoder fastdllm with a cache (prefix or dual), "
                              f"polestar and polestar_v; "
                              f"decoder {self.decoder} with cache {self.cache} keeps "
                              + ("no K/V cache" if self.cache == "none" else "its K/V cache in the model's dtype"))
        if self.decoder == "polestar":
            self._validate_polestar()
        if self.decoder == "polestar_v":
            self._validate_polestar_v()
        if self.decoder == "llada":
            if self.cache != "none":
                raise ConfigError("decoder 'llada' has no cache (use --cache none or decoder fastdllm)")
            if self.threshold is not None or self.factor is not None:
                raise ConfigError("decoder 'llada' commits a fixed number of tokens per step; "
                                  "threshold/factor belong to decoder 'fastdllm'")

    #: The PolestarConfig fields decoder ``polestar_v`` reads (the others belong to the LLaDA path's Polestar
    #: and must keep their defaults with it: never a silently ignored setting).
    POLESTAR_V_FIELDS = ("n_clusters", "prefix_blocks", "suffix_blocks", "kmeans_iters", "top_k",
                         "trigger_commits", "trigger_accum", "history", "early_threshold", "gate_center",
                         "gate_scale", "gate_max_delta")

    def _validate_polestar_v(self) -> None:
        pc = self.polestar
        if self.cache != "prefix":
            raise ConfigError("decoder 'polestar_v' runs on the prefix cache (use --cache prefix)")
        if self.threshold is None or self.factor is not None:
            raise ConfigError("decoder 'polestar_v' needs a confidence threshold (and no factor rule)")
        if self.remasking != "low_confidence":
            raise ConfigError("decoder 'polestar_v' supports remasking low_confidence only")
        default = PolestarConfig()
        other = [f.name for f in dataclasses.fields(PolestarConfig)
                 if f.name not in self.POLESTAR_V_FIELDS and getattr(pc, f.name) != getattr(default, f.name)]
        if other:
            raise ConfigError(f"Polestar setting(s) {', '.join(other)} do not apply to decoder 'polestar_v' "
                              "(LLaDA-V's Polestar)")
        if pc.early_threshold is not None and pc.early_threshold >= self.threshold:
            raise ConfigError(f"invalid Polestar setting: early_threshold {pc.early_threshold} is not below the "
                              f"threshold {self.threshold}, so early commit could never fire (use none to "
                              "switch it off)")

    def _validate_polestar(self) -> None:
        pc, B = self.polestar, self.block_length
        if self.cache != "dual":
            raise ConfigError("decoder 'polestar' runs on the dual cache (use --cache dual)")
        if self.threshold is None or self.factor is not None:
            raise ConfigError("decoder 'polestar' needs a confidence threshold (and no factor rule)")
        if self.remasking != "low_confidence":
            raise ConfigError("decoder 'polestar' supports remasking low_confidence only (its commit gates "
                              "are defined on the model's confidence)")
        rows = pc.window_rows(B)
        if pc.n_clusters > rows:
            raise ConfigError(f"invalid Polestar setting: n_clusters {pc.n_clusters} is larger than the window "
                              f"rows {rows} ((prefix_blocks + suffix_blocks) x block length {B})")
        if (pc.refresh_buckets or 1) > rows:
            raise ConfigError(f"invalid Polestar setting: refresh_buckets {pc.refresh_buckets} is larger than "
                              f"the window rows {rows} (a bucket holds at least one row)")
        if pc.early_threshold is not None and pc.early_threshold >= self.threshold:
            raise ConfigError(f"invalid Polestar setting: early_threshold {pc.early_threshold} is not below the "
                              f"threshold {self.threshold}, so early commit could never fire (use none to "
                              "switch it off)")
