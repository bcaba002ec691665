"""Builds the tiny RANDOM (untrained) LLaDA model bundled with polestar_jax.

The folder is in the Hugging Face layout of LLaDA-8B-Instruct (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with LLaDA's chat template, ...), but the model has 2 layers
of width 64 with random weights and a byte-level tokenizer (the 256 byte symbols, no merges, plus LLaDA's
special tokens). It produces gibberish; it exists so that ``python -m polestar_jax.generate`` and the
tests run offline without downloading a checkpoint.

Everything is deterministic in ``--seed`` (``numpy.random.default_rng(seed)``): rebuilding gives
byte-identical files.

Usage::

    python bench/make_tiny_random.py [--out polestar_jax/assets/tiny_random] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from polestar_jax.config import ModelConfig

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(_REPO_ROOT, "polestar_jax", "assets", "tiny_random")

#: LLaDA-8B-Instruct's chat template, verbatim.
LLADA_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"  # also the pad token, as in LLaDA
MASK_TOKEN = "<|mdm_mask|>"
#: Special tokens, in id order after the 256 byte symbols.
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", MASK_TOKEN]

# Architecture of the tiny model.
N_LAYERS, D_MODEL, N_HEADS, N_KV_HEADS, MLP_HIDDEN = 2, 64, 4, 4, 128
MAX_SEQ_LEN, ROPE_THETA, RMS_EPS = 1024, 500000.0, 1e-5
LINEAR_STD, NORM_JITTER = 0.02, 0.02


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level alphabet of ``tokenizers``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE tokenizer with no merges: id ``b`` is byte ``b``; special tokens from 256, padded
    with reserved special tokens to a multiple of 8."""
    byte_map = bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet()), "byte map differs from ByteLevel alphabet"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = list(SPECIAL_TOKENS)
    n_reserved = (-(256 + len(specials))) % 8
    specials += [f"<|reserved_token_{i}|>" for i in range(n_reserved)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    for i, t in enumerate(specials):
        assert tok.token_to_id(t) == 256 + i, (t, tok.token_to_id(t))
    return tok


def check_round_trip(tok: Tokenizer) -> None:
    """Asserts that encode -> decode is the identity on ASCII and non-ASCII UTF-8 text."""
    samples = ["Hello, world!", "  two  spaces\tand\nnewlines\r\n", "naïve café — 日本語 😀 Ωμέγα",
               "x = 1 + 2 * (3 / 4)", "", "\x00\x7f control"]
    for text in samples:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == len(text.encode("utf-8")), (text, ids)
        assert tok.decode(ids, skip_special_tokens=True) == text, (text, tok.decode(ids))
    ids = tok.encode(f"{BOS_TOKEN}hi<|eot_id|>", add_special_tokens=False).ids
    assert ids == [tok.token_to_id(BOS_TOKEN), ord("h"), ord("i"), tok.token_to_id("<|eot_id|>")], ids


def make_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights with LLaDA's HF parameter names (linear weights ``[out, in]``)."""
    rng = np.random.default_rng(seed)
    V, D, F = cfg.embedding_size, cfg.d_model, cfg.mlp_hidden_size
    kv = cfg.n_kv_heads * cfg.head_dim

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (np.float32(1.0) + normal((n,), NORM_JITTER)).astype(np.float32)

    p = "model.transformer."
    w: dict[str, np.ndarray] = {p + "wte.weight": normal((V, D), 1.0 / np.sqrt(D))}
    for i in range(cfg.n_layers):
        b = f"{p}blocks.{i}."
        w[b + "attn_norm.weight"] = norm(D)
        w[b + "q_proj.weight"] = normal((D, D), LINEAR_STD)
        w[b + "k_proj.weight"] = normal((kv, D), LINEAR_STD)
        w[b + "v_proj.weight"] = normal((kv, D), LINEAR_STD)
        w[b + "attn_out.weight"] = normal((D, D), LINEAR_STD)
        w[b + "ff_norm.weight"] = norm(D)
        w[b + "ff_proj.weight"] = normal((F, D), LINEAR_STD)
        w[b + "up_proj.weight"] = normal((F, D), LINEAR_STD)
        w[b + "ff_out.weight"] = normal((D, F), LINEAR_STD)
    w[p + "ln_f.weight"] = norm(D)
    head = normal((V, D), LINEAR_STD)
    head[cfg.mask_token_id] = 0.0  # the mask token gets logit 0 whatever the input
    w[p + "ff_out.weight"] = head
    return w


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def _readme(cfg: ModelConfig, seed: int, n_params: int) -> str:
    return f"""# tiny_random: a tiny RANDOM LLaDA model (not trained)

This folder is a **randomly initialised, untrained** model with the LLaDA architecture
(`block_type=llama`: RMSNorm, RoPE, SwiGLU, bidirectional attention) and a **byte-level tokenizer**.
It produces gibberish. It exists only so that `python -m polestar_jax.generate` and the tests run
offline without downloading a real checkpoint such as LLaDA-8B-Instruct.

* Architecture: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads ({cfg.n_kv_heads} KV heads),
  MLP hidden {cfg.mlp_hidden_size}, vocabulary/embedding size {cfg.embedding_size}, {n_params:,} float32 parameters.
* Tokenizer: ids 0..255 are the 256 bytes (GPT-2 byte-level symbols, no merges), then the special tokens
  {", ".join(f"`{t}`" for t in SPECIAL_TOKENS)} (ids 256..{255 + len(SPECIAL_TOKENS)}) and reserved
  tokens up to {cfg.embedding_size}. Any UTF-8 text round-trips.
  bos `{BOS_TOKEN}`, eos = pad `{EOS_TOKEN}` (id {cfg.eos_token_id}), mask `{MASK_TOKEN}` (id {cfg.mask_token_id}).
* Chat template: LLaDA-8B-Instruct's, verbatim (in `tokenizer_config.json`).
* Files use the Hugging Face layout of LLaDA-8B-Instruct (`config.json`, `model.safetensors`, ...).

Made by `python bench/make_tiny_random.py --seed {seed}` (weights from `numpy.random.default_rng({seed})`:
normal with std 0.02 for linear layers, 1/sqrt(d_model) for the embedding, 1 + N(0, {NORM_JITTER}) for
norm weights; the LM-head row of the mask token is zero). Rebuilding gives byte-identical files.
"""


def build(out_dir: str, seed: int = 0) -> ModelConfig:
    """Writes the tiny random model folder to ``out_dir`` and returns its config."""
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer()
    check_round_trip(tok)
    V = tok.get_vocab_size(with_added_tokens=True)
    assert V % 8 == 0, V
    eos_id, mask_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id(MASK_TOKEN)
    cfg = ModelConfig(d_model=D_MODEL, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, n_layers=N_LAYERS,
                      mlp_hidden_size=MLP_HIDDEN, vocab_size=V, embedding_size=V, mask_token_id=mask_id,
                      eos_token_id=eos_id, pad_token_id=eos_id, max_sequence_length=MAX_SEQ_LEN,
                      rope_theta=ROPE_THETA, rms_norm_eps=RMS_EPS)
    cfg.validate("tiny_random")

    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=True)

    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = "float32"
    hf_cfg["bos_token_id"] = tok.token_to_id(BOS_TOKEN)
    _write_json(os.path.join(out_dir, "config.json"), hf_cfg)

    added = {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i, t in sorted(tok.get_added_tokens_decoder().items())}
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "mask_token": MASK_TOKEN,
        "chat_template": LLADA_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MAX_SEQ_LEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), {
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "mask_token": MASK_TOKEN})
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": tok.token_to_id(BOS_TOKEN), "eos_token_id": eos_id, "pad_token_id": eos_id})

    weights = make_weights(cfg, seed)
    weights_path = os.path.join(out_dir, "model.safetensors")
    save_file(weights, weights_path, metadata={"format": "pt"})
    os.chmod(weights_path, 0o644)  # safetensors creates the file owner-only
    n_params = sum(int(a.size) for a in weights.values())
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(_readme(cfg, seed, n_params))
    return cfg


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: %(default)s)")
    args = ap.parse_args(argv)
    cfg = build(args.out, args.seed)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.out}: vocab {cfg.vocab_size}, eos {cfg.eos_token_id}, mask {cfg.mask_token_id}, "
          f"{size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
