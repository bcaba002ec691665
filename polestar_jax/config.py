"""Configurations as frozen dataclasses.

* :class:`ModelConfig`: the LLaDA architecture, read from a Hugging Face ``config.json``.
* :class:`DecodeConfig`: which decoder runs (``llada``, ``fastdllm``) and its knobs.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Literal, Optional

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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a LLaDA model (``block_type=llama``).

    Attributes mirror the HF ``config.json`` of LLaDA-8B-Instruct; ``embedding_size`` is the number of rows
    of the embedding and LM-head matrices (>= ``vocab_size``).
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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "ModelConfig":
        """Builds a config from a parsed HF ``config.json``; raises :class:`ConfigError` on anything we
        cannot run (another architecture, missing fields, inconsistent shapes)."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        model_type = d.get("model_type", "llada")
        if model_type != "llada":
            raise ConfigError(f"{source}: model_type {model_type!r} is not a LLaDA model (expected 'llada')")
        missing = [f for f in _REQUIRED_FIELDS if f not in d]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
        for key, want in _REQUIRED_VALUES.items():
            if key in d and d[key] is not None and d[key] != want:
                raise ConfigError(f"{source}: unsupported {key}={d[key]!r} (this implementation needs {want!r})")
        if d.get("include_qkv_bias"):
            raise ConfigError(f"{source}: unsupported include_qkv_bias=True")
        n_heads = int(d["n_heads"])
        n_kv = d.get("n_kv_heads") or n_heads
        if d.get("multi_query_attention"):
            n_kv = 1
        vocab = int(d["vocab_size"])
        emb = int(d.get("embedding_size") or vocab)
        cfg = cls(
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
        cfg.validate(source)
        return cfg

    @classmethod
    def from_json(cls, path: str) -> "ModelConfig":
        """Reads ``path`` (a ``config.json`` or a folder holding one)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        try:
            with open(path) as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, source=path)

    def validate(self, source: str = "config") -> None:
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
        if not 0 <= self.mask_token_id < self.embedding_size:
            raise ConfigError(f"{source}: mask_token_id {self.mask_token_id} outside the embedding")

    def to_hf_dict(self) -> dict:
        """The HF ``config.json`` fields this config was read from (enough to load it again)."""
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


Cache = Literal["none", "prefix", "dual"]
Rule = Literal["fixed", "threshold", "factor"]

DECODERS = ("llada", "fastdllm", "polestar")
CACHES = ("none", "prefix", "dual")
REMASKING = ("low_confidence", "random")


@dataclasses.dataclass(frozen=True)
class PolestarConfig:
    """The knobs of Polestar-Cache and Polestar-Commit; defaults equal the official PyTorch code.

    Cache (refresh of stale cached hidden states):
      n_clusters      total k-means clusters per layer, split between the prefix and suffix windows
                      (prefix gets ``min(n-1, max(1, n * pre_len // (pre_len + suf_len)))``).
      prefix_blocks   prefix window = this many block lengths before the block.
      suffix_blocks   suffix window = this many block lengths after the block.
      kmeans_iters    k-means iterations (cosine assignment, raw-mean centroids).
      top_k           clusters refreshed per layer; ``top_k_last`` at the last layer.
      windowed_period every ``windowed_period``-th block (b % period == period - 1) starts with a pass over
                      the window only instead of a full pass (0: always a full pass).
      trigger_commits a decode step refreshes when the previous step committed more than this many tokens,
      trigger_accum   or when the commits since the last refresh exceed this.
    Commit (early commit of converged tokens):
      history         token-drift history length (delta = drift - mean of the history).
      early_threshold tokens with ``early_threshold < conf < threshold`` and
                      ``gate_scale * max(0, gate_center - conf)^2 <= delta < gate_max_delta`` commit early
                      (None disables early commit).
      suffix_precommit refreshed suffix rows (last layer's top cluster) whose prediction has confidence
                      >= threshold are committed ahead of their block.
    Implementation:
      kernels         "auto" (Pallas on GPU/TPU, the jnp reference on CPU), "pallas", "interpret" (the
                      Pallas kernels in the interpreter: slow, for tests) or "reference".
      offload_hidden  how the refresh rows' stored hidden states are kept: "none" (model dtype, device
                      memory: exact), "int8" (symmetric int8 with one float32 scale per row) or "bf16";
                      "int8" and "bf16" live in host memory (``memory_kind="pinned_host"``) where the
                      backend has it; a refresh moves only the rows it reads to the device.
      refresh_buckets a refresh stage runs over the smallest of the widths 0, ceil(R / q), ceil(2R / q), ..., R
                      (``q`` = this, ``R`` = window rows) that holds every batch row's selected rows: more
                      buckets, fewer rows gathered, computed and moved, more compiled branches. The result
                      never depends on it (see :mod:`polestar_jax.refresh`); 1: always all rows.
    """

    n_clusters: int = 8
    prefix_blocks: int = 2
    suffix_blocks: int = 1
    kmeans_iters: int = 5
    top_k: int = 4
    top_k_last: int = 1
    windowed_period: int = 4
    trigger_commits: int = 1
    trigger_accum: int = 2
    history: int = 5
    early_threshold: Optional[float] = 0.7
    gate_center: float = 0.9
    gate_scale: float = 10.0
    gate_max_delta: float = 2.0
    suffix_precommit: bool = True
    kernels: str = "auto"
    offload_hidden: str = "none"
    refresh_buckets: int = 4

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(f"invalid Polestar setting: {msg}")

        need(self.offload_hidden in OFFLOAD_HIDDEN,
             f"offload_hidden must be one of {', '.join(OFFLOAD_HIDDEN)}, got {self.offload_hidden!r}")

        need(isinstance(self.refresh_buckets, int) and self.refresh_buckets >= 1,
             f"refresh_buckets must be an integer >= 1, got {self.refresh_buckets!r}")
        need(self.n_clusters >= 2, f"n_clusters must be >= 2, got {self.n_clusters}")
        need(self.prefix_blocks >= 1, f"prefix_blocks must be >= 1, got {self.prefix_blocks}")
        need(self.suffix_blocks >= 0, f"suffix_blocks must be >= 0, got {self.suffix_blocks}")
        need(self.kmeans_iters >= 1, f"kmeans_iters must be >= 1, got {self.kmeans_iters}")
        need(self.top_k >= 0 and self.top_k_last >= 0, "top_k and top_k_last must be >= 0")
        need(self.windowed_period == 0 or self.windowed_period >= 2,
             f"windowed_period must be 0 (never) or >= 2, got {self.windowed_period}")
        need(self.trigger_commits >= 0 and self.trigger_accum >= 0, "refresh triggers must be >= 0")
        need(self.history >= 1, f"history must be >= 1, got {self.history}")
        need(self.early_threshold is None or 0.0 <= self.early_threshold <= 1.0,
             f"early_threshold must be in [0, 1] or None, got {self.early_threshold}")
        need(self.gate_scale >= 0, f"gate_scale must be >= 0, got {self.gate_scale}")
        need(self.kernels in ("auto", "pallas", "interpret", "reference"),
             f"kernels must be auto, pallas, interpret or reference, got {self.kernels!r}")


#: Storage modes of Polestar's hidden-state store (:attr:`PolestarConfig.offload_hidden`).
OFFLOAD_HIDDEN = ("none", "int8", "bf16")


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
    """

    decoder: str = "fastdllm"
    cache: str = "dual"
    gen_length: int = 128
    block_length: int = 32
    steps: Optional[int] = None  # default: gen_length
    threshold: Optional[float] = 0.9
    factor: Optional[float] = None
    temperature: float = 0.0
    remasking: str = "low_confidence"
    # Fast-dLLM (prefix/dual cache) runs its step loop at least once after the block's full forward, even
    # when that forward filled the block; Polestar's port of the same loop checks for masks first.
    step_after_full_pass: bool = True
    polestar: PolestarConfig = dataclasses.field(default_factory=PolestarConfig)

    def __post_init__(self):
        if self.steps is None:
            object.__setattr__(self, "steps", self.gen_length)
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
        if self.decoder not in DECODERS:
            raise ConfigError(f"unknown decoder {self.decoder!r} (choose from {', '.join(DECODERS)})")
        if self.cache not in CACHES:
            raise ConfigError(f"unknown cache {self.cache!r} (choose from {', '.join(CACHES)})")
        if self.remasking not in REMASKING:
            raise ConfigError(f"unknown remasking {self.remasking!r} (choose from {', '.join(REMASKING)})")
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
        if self.decoder == "polestar":
            if self.cache != "dual":
                raise ConfigError("decoder 'polestar' runs on the dual cache (use --cache dual)")
            if self.threshold is None or self.factor is not None:
                raise ConfigError("decoder 'polestar' needs a confidence threshold (and no factor rule)")
        if self.decoder == "llada":
            if self.cache != "none":
                raise ConfigError("decoder 'llada' has no cache (use --cache none or decoder fastdllm)")
            if self.threshold is not None or self.factor is not None:
                raise ConfigError("decoder 'llada' commits a fixed number of tokens per step; "
                                  "threshold/factor belong to decoder 'fastdllm'")
