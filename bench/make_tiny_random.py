"""Builds the tiny RANDOM (untrained) models bundled with polestar_jax: a LLaDA and a Dream one.

``--family llada`` (the default) writes ``polestar_jax/assets/tiny_random``: the Hugging Face layout of
LLaDA-8B-Instruct (``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with
LLaDA's chat template, ...), but the model has 2 layers of width 64 with random weights and a byte-level
tokenizer (the 256 byte symbols, no merges, plus LLaDA's special tokens).

``--family dream`` writes ``polestar_jax/assets/tiny_dream``: the layout of Dream-v0-Instruct-7B
(``config.json`` with ``model_type`` Dream and the Qwen2 keys, Qwen2 tensor names with q/k/v biases, an untied
head, grouped KV heads) with 2 layers of width 64, and a small Qwen2-style byte-level BPE tokenizer trained
here with the ``tokenizers`` library (Qwen2's split regex and NFC, :func:`polestar_jax.io.tokenizer.qwen2_pipeline`;
:data:`DREAM_MERGES` merges learned from the fixed :data:`DREAM_CORPUS`), Qwen2's and Dream's special tokens
(``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ..., ``<|beginoftext|>``, ``<|mask|>``) and the ChatML
chat template.

Both produce gibberish; they exist so that ``python -m polestar_jax.generate`` and the tests run offline
without downloading a checkpoint. Everything is deterministic in ``--seed`` (``numpy.random.default_rng(seed)``):
rebuilding gives byte-identical files.

Usage::

    python bench/make_tiny_random.py [--family llada|dream] [--out FOLDER] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from polestar_jax.config import ModelConfig
from polestar_jax.io.tokenizer import asset_model_dir, qwen2_pipeline

#: The bundled folder this script builds (``polestar_jax/assets/tiny_random``).
DEFAULT_OUT = asset_model_dir("tiny_random")
#: The bundled folder ``--family dream`` builds.
DREAM_OUT = asset_model_dir("tiny_dream")

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


def _draws(seed: int):
    """``(normal(shape, std), norm(n))``: float32 draws from ``numpy.random.default_rng(seed)``, in call order
    (norm weights are 1 + N(0, NORM_JITTER))."""
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (np.float32(1.0) + normal((n,), NORM_JITTER)).astype(np.float32)

    return normal, norm


def make_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights with LLaDA's HF parameter names (linear weights ``[out, in]``)."""
    normal, norm = _draws(seed)
    V, D, F = cfg.embedding_size, cfg.d_model, cfg.mlp_hidden_size
    kv = cfg.n_kv_heads * cfg.head_dim

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


def _save_weights(out_dir: str, weights: dict) -> int:
    """Writes ``weights`` (name -> numpy array) to ``out_dir/model.safetensors``; returns the parameter count."""
    path = os.path.join(out_dir, "model.safetensors")
    save_file(weights, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)  # safetensors creates the file owner-only
    return sum(int(a.size) for a in weights.values())


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


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

    n_params = _save_weights(out_dir, make_weights(cfg, seed))
    _write_text(os.path.join(out_dir, "README.md"), _readme(cfg, seed, n_params))
    return cfg


# ------------------------------------------------------------------------------------------------ Dream

#: The added tokens of the Dream tokenizer, after the BPE vocabulary: Qwen2's (Qwen2.5's order and special
#: flags: the tool-call, fill-in-the-middle and repository tags are plain added tokens), then Dream's two.
DREAM_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<|beginoftext|>", True), ("<|mask|>", True),
)
DREAM_EOS = "<|endoftext|>"  # also pad (and, in config.json, the bos id), as in Dream-7B
DREAM_MASK = "<|mask|>"
#: The special tokens tokenizer_config.json lists as additional (Qwen2's chat and vision tokens).
DREAM_EXTRA_SPECIALS = [t for t, special in DREAM_ADDED_TOKENS[1:14] if special]
#: The ChatML chat template in Qwen2's form (a default system turn when the conversation has none).
DREAM_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: BPE merges learned from :data:`DREAM_CORPUS`; the embedding is padded to a multiple of 128 rows.
DREAM_MERGES, DREAM_VOCAB_MULTIPLE = 300, 128
DREAM_LAYERS, DREAM_HIDDEN, DREAM_HEADS, DREAM_KV_HEADS, DREAM_INTERMEDIATE = 2, 64, 4, 2, 128
DREAM_MAX_POS, DREAM_ROPE_THETA, DREAM_RMS_EPS = 1024, 1000000.0, 1e-6
#: The fixed corpus the Dream tokenizer's merges are learned from (English, code, digits, other scripts).
DREAM_CORPUS = (
    "You are a helpful assistant. The user asks a question and the assistant answers it.",
    "A diffusion language model starts from a fully masked answer and fills in the tokens over several steps.",
    "Each step predicts every masked position at once; the most confident predictions are committed first.",
    "The key and value cache stores the attention inputs of the prompt, so later steps do not recompute them.",
    "Polestar refreshes only the cached rows whose attention drifted, and commits converged tokens early.",
    "Dream is a seven billion parameter model with the Qwen2 architecture, trained to denoise masked text.",
    "The quick brown fox jumps over the lazy dog. The lazy dog does not jump over the quick brown fox.",
    "What is the capital of France? The capital of France is Paris. What is the capital of Japan? Tokyo.",
    "Please write a short poem about the sea, the wind and the stars that shine over the quiet harbour.",
    "I'm sure they'll say we've done what we couldn't do before, and it's true: we did it together.",
    "There are 12 months in a year, 7 days in a week, 24 hours in a day and 60 minutes in an hour.",
    "Compute 347 + 85 = 432, then 432 * 2 = 864, and finally 864 - 64 = 800. The answer is 800.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))  # prints 5\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n        print(i, 'is odd')\n",
    "import numpy as np\nx = np.zeros((4, 4), dtype=np.float32)\ny = x @ x.T + 1.0\n",
    "class Model:\n    def __init__(self, layers):\n        self.layers = layers\n\n    def forward(self, x):\n"
    "        for layer in self.layers:\n            x = layer(x)\n        return x\n",
    '{"name": "tiny", "layers": 2, "hidden_size": 64, "vocab_size": 640, "heads": [4, 2]}',
    "<html><body><p>Hello, world!</p><a href=\"https://example.com/path?q=1&r=2\">link</a></body></html>",
    "Question: A train travels 120 kilometres in 2 hours. How fast does it travel? Answer: 60 km/h.",
    "Let's think step by step. First, we add the numbers. Then we divide the sum by the count.",
    "The mitochondria is the powerhouse of the cell; photosynthesis happens in the chloroplasts.",
    "Naïve café owners in Zürich serve crème brûlée, façade, jalapeño and piñata-shaped cookies.",
    "日本語のテキストも少し含めます。東京は日本の首都です。",
    "中文文本：扩散语言模型逐步填充被遮盖的词元。",
    "Ελληνικά: Καλημέρα κόσμε. Русский: Привет, мир. العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया।",
    "Emoji: 😀 🚀 🌍 ✨ — dashes, “quotes”, ‘apostrophes’, ellipsis… and the euro sign €.",
    "Tabs\tand  double  spaces,\r\nWindows newlines,\n\nblank lines and trailing spaces   \n",
    "user: hello\nassistant: Hello! How can I help you today?\nuser: tell me a joke\n",
    "The answer is 42. The answer is 42. The answer is 42. Therefore, the final answer is 42.",
    "Sorting the list [5, 3, 8, 1] gives [1, 3, 5, 8]; reversing it gives [8, 5, 3, 1].",
)


def build_dream_tokenizer() -> Tokenizer:
    """Qwen2-style byte-level BPE (:func:`polestar_jax.io.tokenizer.qwen2_pipeline`): ids 0..255 are GPT-2's byte
    symbols in code-point order (``!`` is 0, as in GPT-2's and Qwen2's vocabularies), then the
    :data:`DREAM_MERGES` merged symbols learned from :data:`DREAM_CORPUS` by ``tokenizers``' BPE trainer, in
    the order learned, then :data:`DREAM_ADDED_TOKENS`."""
    trainer = trainers.BpeTrainer(vocab_size=256 + DREAM_MERGES, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    learner = qwen2_pipeline(Tokenizer(models.BPE()))
    learner.train_from_iterator(list(DREAM_CORPUS), trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    vocab = {c: i for i, c in enumerate(sorted(bytes_to_unicode().values()))}  # GPT-2 / Qwen2's byte ids
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    assert vocab == learned["vocab"], "the trainer's vocabulary is not the byte symbols then the merges"
    assert len(merges) == DREAM_MERGES == len(vocab) - 256, (len(merges), len(vocab))
    tok = qwen2_pipeline(Tokenizer(models.BPE(vocab=vocab, merges=merges)))
    for i, (content, special) in enumerate(DREAM_ADDED_TOKENS):
        (tok.add_special_tokens if special else tok.add_tokens)([AddedToken(content, special=special,
                                                                            normalized=False)])
        assert tok.token_to_id(content) == len(vocab) + i, (content, tok.token_to_id(content))
    return tok


def check_dream_round_trip(tok: Tokenizer) -> None:
    """Asserts that encode -> decode is the identity on (NFC) text of several scripts, that digits are split
    one by one, and that the added tokens are single ids."""
    for text in DREAM_CORPUS + ("", "naïve 日本語 😀", "x = 12345"):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=True) == text, (text, tok.decode(ids))
    assert len(tok.encode("12345").ids) == 5
    for content, _ in DREAM_ADDED_TOKENS:
        assert tok.encode(f"a{content}b").ids == [tok.token_to_id("a"), tok.token_to_id(content),
                                                  tok.token_to_id("b")], content


def make_dream_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights with Dream's (Qwen2's) HF names, in its state-dict order (linear weights
    ``[out, in]``; q/k/v biases; untied LM head whose mask-token row is zero)."""
    normal, norm = _draws(seed)
    V, D, F = cfg.embedding_size, cfg.d_model, cfg.mlp_hidden_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal((V, D), 1.0 / np.sqrt(D))}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            w[f"{p}self_attn.{name}_proj.weight"] = normal((rows, D), LINEAR_STD)
            w[f"{p}self_attn.{name}_proj.bias"] = normal((rows,), LINEAR_STD)
        w[p + "self_attn.o_proj.weight"] = normal((D, q), LINEAR_STD)
        w[p + "mlp.gate_proj.weight"] = normal((F, D), LINEAR_STD)
        w[p + "mlp.up_proj.weight"] = normal((F, D), LINEAR_STD)
        w[p + "mlp.down_proj.weight"] = normal((D, F), LINEAR_STD)
        w[p + "input_layernorm.weight"] = norm(D)
        w[p + "post_attention_layernorm.weight"] = norm(D)
    w["model.norm.weight"] = norm(D)
    head = normal((V, D), LINEAR_STD)
    head[cfg.mask_token_id] = 0.0  # the mask token gets logit 0 whatever the input
    w["lm_head.weight"] = head
    return w


def _dream_config(tok: Tokenizer) -> ModelConfig:
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    V = DREAM_VOCAB_MULTIPLE * -(-n_tok // DREAM_VOCAB_MULTIPLE)
    eos = tok.token_to_id(DREAM_EOS)
    cfg = ModelConfig(d_model=DREAM_HIDDEN, n_heads=DREAM_HEADS, n_kv_heads=DREAM_KV_HEADS, n_layers=DREAM_LAYERS,
                      mlp_hidden_size=DREAM_INTERMEDIATE, vocab_size=V, embedding_size=V,
                      mask_token_id=tok.token_to_id(DREAM_MASK), eos_token_id=eos, pad_token_id=eos,
                      max_sequence_length=DREAM_MAX_POS, rope_theta=DREAM_ROPE_THETA, rms_norm_eps=DREAM_RMS_EPS,
                      include_qkv_bias=True, family="dream")
    cfg.validate("tiny_dream")
    return cfg


def _write_dream_tokenizer(out_dir: str, tok: Tokenizer) -> None:
    """tokenizer.json, and the same BPE as Qwen2's slow-tokenizer files (vocab.json, merges.txt), with
    tokenizer_config.json (added tokens, special tokens, the chat template) and special_tokens_map.json."""
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=True)
    model = json.loads(tok.to_str())["model"]
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(dict(sorted(model["vocab"].items(), key=lambda kv: kv[1])), f, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(" ".join(m if isinstance(m, list) else m.split(" ")) + "\n"
                                           for m in model["merges"]))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": special}
             for t, special in DREAM_ADDED_TOKENS}
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": DREAM_EXTRA_SPECIALS, "bos_token": None,
        "chat_template": DREAM_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": DREAM_EOS,
        "errors": "replace", "mask_token": DREAM_MASK, "model_max_length": DREAM_MAX_POS, "pad_token": DREAM_EOS,
        "split_special_tokens": False, "tokenizer_class": "DreamTokenizer",
    })
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), {
        "additional_special_tokens": DREAM_EXTRA_SPECIALS, "eos_token": DREAM_EOS, "mask_token": DREAM_MASK,
        "pad_token": DREAM_EOS})


def build_dream(out_dir: str, seed: int = 0) -> ModelConfig:
    """Writes the tiny random Dream model folder (``--family dream``) to ``out_dir``; returns its config."""
    os.makedirs(out_dir, exist_ok=True)
    tok = build_dream_tokenizer()
    check_dream_round_trip(tok)
    cfg = _dream_config(tok)
    _write_dream_tokenizer(out_dir, tok)
    eos = cfg.eos_token_id
    hf_cfg = cfg.to_hf_dict()
    hf_cfg.update({"attention_dropout": 0.0, "bos_token_id": eos, "initializer_range": 0.02,
                   "max_window_layers": cfg.n_layers, "sliding_window": None, "torch_dtype": "float32",
                   "use_cache": False, "use_sliding_window": False})
    _write_json(os.path.join(out_dir, "config.json"), hf_cfg)
    assert ModelConfig.from_json(out_dir) == cfg
    _write_json(os.path.join(out_dir, "generation_config.json"), {  # Dream-7B's keys; our lengths: 128 / 32
        "_from_model_config": True, "alg": "origin", "alg_temp": None, "bos_token_id": eos, "eos_token_id": eos,
        "eps": 0.001, "mask_token_id": None, "output_history": False, "pad_token_id": eos, "steps": 512,
        "temperature": 0.0, "top_k": None, "top_p": None})
    n_params = _save_weights(out_dir, make_dream_weights(cfg, seed))
    _write_text(os.path.join(out_dir, "README.md"), _dream_readme(cfg, tok, seed, n_params))
    return cfg


def _dream_readme(cfg: ModelConfig, tok: Tokenizer, seed: int, n_params: int) -> str:
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    first = 256 + DREAM_MERGES
    return f"""# tiny_dream: a tiny RANDOM Dream model (not trained)

This folder is a **randomly initialised, untrained** model with the Dream-7B architecture (the Qwen2 layout:
RMSNorm, RoPE theta {cfg.rope_theta:,.0f}, SwiGLU, q/k/v biases, grouped KV heads, untied LM head, bidirectional
attention; `model_type` Dream) and a **small Qwen2-style byte-level BPE tokenizer**. It produces gibberish. It
exists so that the Dream paths of `python -m polestar_jax.generate`, the text API, the converter,
`python -m polestar_jax.eval` and the tests run offline without downloading Dream-v0-Instruct-7B.

* Architecture: {cfg.n_layers} layers, hidden {cfg.d_model}, {cfg.n_heads} heads ({cfg.n_kv_heads} KV heads), \
intermediate {cfg.mlp_hidden_size}, vocabulary/embedding
  {cfg.vocab_size} rows, {n_params:,} float32 parameters.
* Tokenizer (`tokenizer.json`, and the same BPE as `vocab.json` + `merges.txt`): NFC, Qwen2's split regex
  (single digits), GPT-2's byte symbols as ids 0..255, {DREAM_MERGES} merges (ids 256..{first - 1}) learned by the
  `tokenizers` BPE trainer from the fixed corpus in `bench/make_tiny_random.py`, then Qwen2's and Dream's added
  tokens (ids {first}..{n_tok - 1}): `<|endoftext|>` (eos = pad, id {cfg.eos_token_id}), `<|im_start|>`, \
`<|im_end|>`, ..., `<|beginoftext|>`,
  `<|mask|>` (id {cfg.mask_token_id}); embedding rows {n_tok}..{cfg.vocab_size - 1} are padding, as Dream-7B's \
152064 rows pad its 151667 tokens.
* `tokenizer_config.json`: the added tokens, eos = pad `<|endoftext|>`, mask `<|mask|>`, no bos token,
  `tokenizer_class` DreamTokenizer, and the ChatML chat template in Qwen2's form (a default
  "You are a helpful assistant." system turn). Written from the Dream/Qwen2 conventions as we know them; not
  compared with the files of the real checkpoint, which are not available here.
* `generation_config.json`: Dream-7B's keys (alg, steps 512, eps, ids); it sets no `gen_length` /
  `block_length`, so the defaults are 128 / 32.
* Not included: Dream's remote-code files (`configuration_dream.py`, ...); nothing here needs them.

Made by `python bench/make_tiny_random.py --family dream --seed {seed}` (weights from
`numpy.random.default_rng({seed})`: normal with std {LINEAR_STD} for linear layers and biases, 1/sqrt(hidden)
for the embedding, 1 + N(0, {NORM_JITTER}) for norm weights; the LM-head row of the mask token is zero).
Rebuilding gives byte-identical files.
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=("llada", "dream"), default="llada",
                    help="llada: tiny_random; dream: tiny_dream (default: %(default)s)")
    ap.add_argument("--out", default=None, help=f"output folder (default: {DEFAULT_OUT} for llada, "
                                                f"{DREAM_OUT} for dream)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: %(default)s)")
    args = ap.parse_args(argv)
    out = args.out or (DREAM_OUT if args.family == "dream" else DEFAULT_OUT)
    cfg = build_dream(out, args.seed) if args.family == "dream" else build(out, args.seed)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"wrote {out}: vocab {cfg.vocab_size}, eos {cfg.eos_token_id}, mask {cfg.mask_token_id}, "
          f"{size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
