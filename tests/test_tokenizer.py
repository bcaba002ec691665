"""Tokenizer loading, encode/decode, the LLaDA and Dream chat templates, and the bundled models (tiny_tasks,
tiny_random, tiny_dream; the Qwen2-style BPE of tiny_dream also as vocab.json + merges.txt)."""
from __future__ import annotations

import importlib.resources
import importlib.util
import json
import math
import os
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from polestar_jax.config import ModelConfig
from polestar_jax.errors import PolestarError
from polestar_jax.io.tokenizer import Tokenizer, asset_model_dir, bundled_model_dir, load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED = Path(bundled_model_dir())

LLADA_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
EXPECTED_HI = ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(bundled_model_dir())


def _load_builder() -> ModuleType:
    path = REPO_ROOT / "bench" / "make_tiny_random.py"
    spec = importlib.util.spec_from_file_location("make_tiny_random", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name,limit", [("tiny_tasks", 5_000_000), ("tiny_random", 1_100_000)])
def test_bundled_folders_are_package_data(name: str, limit: int) -> None:
    res = importlib.resources.files("polestar_jax") / "assets" / name
    folder = Path(str(res))
    assert folder == Path(asset_model_dir(name))
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
              "generation_config.json"):
        assert (folder / f).is_file(), f
    assert sum(p.stat().st_size for p in folder.iterdir()) < limit
    # both folders serve the same byte-level tokenizer and chat template
    assert load_tokenizer(folder).chat_prompt_ids("copy: ann") == load_tokenizer(BUNDLED).chat_prompt_ids("copy: ann")


def test_default_model_is_the_trained_one() -> None:
    from polestar_jax.io.checkpoint import generation_defaults

    assert BUNDLED == Path(asset_model_dir("tiny_tasks"))
    d = generation_defaults(BUNDLED)
    assert d["gen_length"] % d["block_length"] == 0 and d["steps"] == d["gen_length"]


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnewlines\r\n",
    "naïve café — 日本語のテキスト 😀 Ωμέγα ∑",
    "",
])
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # byte-level, no merges
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_ascii_ids_are_bytes(tok: Tokenizer) -> None:
    assert tok.encode("Hi!") == [72, 105, 33]


def test_chat_template_llada(tok: Tokenizer) -> None:
    assert tok.chat_template == LLADA_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == EXPECTED_HI
    # the template trims the content
    assert tok.apply_chat_template([{"role": "user", "content": "  Hi \n"}]) == EXPECTED_HI
    no_gen = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_gen == EXPECTED_HI[: -len("<|start_header_id|>assistant<|end_header_id|>\n\n")]
    two = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert two.count("<|startoftext|>") == 1 and two.startswith("<|startoftext|><|start_header_id|>system")


def test_chat_prompt_ids_use_single_special_tokens(tok: Tokenizer) -> None:
    ids = tok.chat_prompt_ids("Hi")
    special = {name: tok.token_to_id(name) for name in
               ("<|startoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")}
    assert all(v is not None and v >= 256 for v in special.values())
    assert ids[0] == special["<|startoftext|>"] == tok.bos_token_id
    assert ids.count(special["<|start_header_id|>"]) == 2
    assert ids.count(special["<|end_header_id|>"]) == 2
    assert ids.count(special["<|eot_id|>"]) == 1
    assert ids == tok.encode(EXPECTED_HI)
    assert tok.decode(ids, skip_special_tokens=False) == EXPECTED_HI
    assert tok.decode(ids, skip_special_tokens=True) == "user\n\nHiassistant\n\n"


def test_special_ids_match_config(tok: Tokenizer) -> None:
    cfg = ModelConfig.from_json(bundled_model_dir())
    assert tok.mask_token_id == cfg.mask_token_id == tok.token_to_id("<|mdm_mask|>")
    assert tok.eos_token_id == cfg.eos_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.pad_token_id == cfg.pad_token_id
    assert tok.vocab_size == cfg.vocab_size == cfg.embedding_size
    assert cfg.vocab_size % 8 == 0


def test_no_chat_template_encodes_raw_text(tmp_path: Path) -> None:
    shutil.copy(BUNDLED / "tokenizer.json", tmp_path / "tokenizer.json")
    t = load_tokenizer(tmp_path)
    assert t.chat_template is None
    assert t.chat_prompt_ids("Hi") == [72, 105]
    assert t.eos_token_id is None
    assert t.mask_token_id == t.token_to_id("<|mdm_mask|>")
    with pytest.raises(PolestarError):
        t.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_special_tokens_as_dicts_and_raise_exception(tmp_path: Path) -> None:
    shutil.copy(BUNDLED / "tokenizer.json", tmp_path / "tokenizer.json")
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|startoftext|>", "special": True},
        "eos_token": {"content": "<|eot_id|>", "special": True},
        "chat_template": template,
    }))
    t = load_tokenizer(tmp_path)
    assert t.eos_token_id == t.token_to_id("<|eot_id|>")
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "<|startoftext|>x<|eot_id|>"
    with pytest.raises(PolestarError, match="user first"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_missing_tokenizer_json_raises(tmp_path: Path) -> None:
    with pytest.raises(PolestarError) as e:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(PolestarError):
        load_tokenizer(tmp_path / "does_not_exist")


def test_corrupt_tokenizer_json_raises(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(PolestarError):
        load_tokenizer(tmp_path)


def test_rebuild_is_byte_identical(tmp_path: Path) -> None:
    builder = _load_builder()
    out = tmp_path / "tiny"
    builder.build(str(out), seed=0)
    random_dir = Path(asset_model_dir("tiny_random"))  # what bench/make_tiny_random.py builds
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (random_dir / name).read_bytes(), name
    assert sorted(os.listdir(out)) == sorted(os.listdir(random_dir))


# ------------------------------------------------------------------------------------------------ Dream
# The bundled tiny_dream folder: a Qwen2-style byte-level BPE (bench/make_tiny_random.py --family dream), its
# added tokens, the ChatML template, and the vocab.json + merges.txt form of the same tokenizer.

DREAM = Path(asset_model_dir("tiny_dream"))
#: Qwen2's published pre-tokenizer regex (Qwen2Tokenizer's PRETOKENIZE_REGEX), written out here independently
QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
DREAM_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
DREAM_HI = DREAM_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
DREAM_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say we've done it; it's TRUE, isn't it?",
    "x = 1234567 + 89.5\n\tdef f(a, b):\n        return a*b  \n\n\n",
    "naïve café — 日本語のテキスト 😀 Ωμέγα ∑ Привет مرحبا",
    "  leading spaces, trailing spaces   ",
    "\r\n\r\nwindows\r\nnewlines",
    "",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|mask|><|mask|>x<|endoftext|>",
    "<tool_call>{\"a\": 1}</tool_call><|fim_prefix|>abc<|fim_suffix|>",
]


@pytest.fixture(scope="module")
def dream_tok() -> Tokenizer:
    return load_tokenizer(DREAM)


def _tokenizer_json_model(folder: Path) -> tuple[dict, list, dict]:
    """(vocab, merges, added tokens by content) read from a tokenizer.json."""
    d = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in d["model"]["merges"]]
    return d["model"]["vocab"], merges, {t["content"]: t for t in d["added_tokens"]}


def _slow_qwen2_encode(text: str, folder: Path) -> list[int]:
    """The slow Qwen2 / DreamTokenizer algorithm, written from its description: split out the added tokens,
    NFC, Qwen2's regex, UTF-8 bytes to GPT-2's symbols, then repeatedly merge the lowest-ranked pair."""
    regex = pytest.importorskip("regex")
    import unicodedata

    vocab, merges, added = _tokenizer_json_model(folder)
    ranks = {m: i for i, m in enumerate(merges)}
    byte_map = _load_builder().bytes_to_unicode()
    specials = regex.compile("(" + "|".join(map(regex.escape, sorted(added, key=len, reverse=True))) + ")")
    out: list[int] = []
    for piece in specials.split(text):
        if piece in added:
            out.append(added[piece]["id"])
            continue
        for word in regex.findall(QWEN2_REGEX, unicodedata.normalize("NFC", piece)):
            symbols = [byte_map[b] for b in word.encode("utf-8")]
            while len(symbols) > 1:
                rank, i = min((ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(symbols, symbols[1:])))
                if rank == math.inf:
                    break
                symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
            out += [vocab[s] for s in symbols]
    return out


def test_dream_folder_is_package_data(dream_tok: Tokenizer) -> None:
    folder = Path(str(importlib.resources.files("polestar_jax") / "assets" / "tiny_dream"))
    assert folder == DREAM
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.json",
              "merges.txt", "special_tokens_map.json", "generation_config.json", "README.md"):
        assert (folder / f).is_file(), f
    assert sum(p.stat().st_size for p in folder.iterdir()) < 2_000_000
    cfg = ModelConfig.from_json(str(folder))
    assert cfg.family == "dream" and cfg.include_qkv_bias and cfg.n_kv_heads < cfg.n_heads
    assert dream_tok.mask_token_id == cfg.mask_token_id == dream_tok.token_to_id("<|mask|>")
    assert dream_tok.eos_token_id == dream_tok.pad_token_id == cfg.eos_token_id == cfg.pad_token_id
    assert cfg.eos_token_id == dream_tok.token_to_id("<|endoftext|>")
    assert dream_tok.vocab_size <= cfg.vocab_size  # padded embedding rows, as Dream-7B's
    assert dream_tok.end_of_turn_ids == {dream_tok.token_to_id("<|im_end|>")}


def test_dream_bpe_is_the_slow_qwen2_algorithm(dream_tok: Tokenizer) -> None:
    """tokenizers' pipeline (NFC, Qwen2 regex, byte-level BPE, added tokens) = the slow algorithm, on
    English, code, digits, other scripts, emoji and special tokens; merges are really used."""
    corpus_line = _load_builder().DREAM_CORPUS[0]
    for text in DREAM_TEXTS + [corpus_line]:
        assert dream_tok.encode(text) == _slow_qwen2_encode(text, DREAM), text
    assert len(dream_tok.encode(corpus_line)) < len(corpus_line.encode()) / 2


def test_dream_round_trips_and_digits(dream_tok: Tokenizer) -> None:
    import unicodedata

    for text in DREAM_TEXTS:
        assert dream_tok.decode(dream_tok.encode(text), skip_special_tokens=False) == text, text
    assert dream_tok.decode(dream_tok.encode("e\u0301t\u00e9")) == "\u00e9t\u00e9"  # NFC before BPE
    assert dream_tok.encode("e\u0301") == dream_tok.encode(unicodedata.normalize("NFC", "e\u0301"))
    ids = dream_tok.encode("2024")
    assert [dream_tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]  # Qwen2 splits single digits
    assert dream_tok.decode(dream_tok.encode("😀")) == "😀"
    assert "\ufffd" in dream_tok.decode(dream_tok.encode("😀")[:1])  # a partial UTF-8 sequence


def test_dream_special_tokens(dream_tok: Tokenizer) -> None:
    builder = _load_builder()
    vocab, merges, added = _tokenizer_json_model(DREAM)
    first = len(vocab)
    assert first == 256 + builder.DREAM_MERGES == 256 + len(merges)
    for i, (content, special) in enumerate(builder.DREAM_ADDED_TOKENS):
        assert dream_tok.token_to_id(content) == first + i and added[content]["special"] is special
        assert dream_tok.encode(f"x{content}y") == dream_tok.encode("x") + [first + i] + dream_tok.encode("y")
    text = "<|im_start|>a<|im_end|><tool_call>b<|mask|>"
    ids = dream_tok.encode(text)
    assert dream_tok.decode(ids, skip_special_tokens=False) == text
    assert dream_tok.decode(ids) == "a<tool_call>b"  # special tokens dropped, plain added tokens kept


def test_dream_chat_template(dream_tok: Tokenizer) -> None:
    assert dream_tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == DREAM_HI
    no_gen = dream_tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_gen == DREAM_HI[: -len("<|im_start|>assistant\n")]
    sys_turn = dream_tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                                              {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}])
    assert sys_turn == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
                        "A<|im_end|>\n<|im_start|>user\nV<|im_end|>\n<|im_start|>assistant\n")
    ids = dream_tok.chat_prompt_ids("Hi")
    assert ids == dream_tok.encode(DREAM_HI)
    assert ids.count(dream_tok.token_to_id("<|im_start|>")) == 3 and ids.count(dream_tok.token_to_id("<|im_end|>")) == 2
    assert dream_tok.decode(ids) == "system\nYou are a helpful assistant.\nuser\nHi\nassistant\n"


def test_dream_vocab_merges_equals_tokenizer_json(tmp_path: Path, dream_tok: Tokenizer) -> None:
    """The folder without tokenizer.json (Qwen2's slow-tokenizer files: vocab.json + merges.txt, the added
    tokens in tokenizer_config.json) loads the same tokenizer; the bundled files are tokenizer.json's BPE."""
    vocab, merges, _ = _tokenizer_json_model(DREAM)
    assert json.loads((DREAM / "vocab.json").read_text(encoding="utf-8")) == vocab
    lines = (DREAM / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("#version") and [tuple(m.split(" ")) for m in lines[1:]] == merges
    for f in ("vocab.json", "merges.txt", "tokenizer_config.json", "config.json"):
        shutil.copy(DREAM / f, tmp_path / f)
    slow = load_tokenizer(tmp_path)
    assert slow.vocab_size == dream_tok.vocab_size and slow.chat_template == dream_tok.chat_template
    for text in DREAM_TEXTS:
        ids = dream_tok.encode(text)
        assert slow.encode(text) == ids, text
        assert slow.decode(ids) == dream_tok.decode(ids) and slow.decode(ids, False) == dream_tok.decode(ids, False)
    assert slow.chat_prompt_ids("Hi") == dream_tok.chat_prompt_ids("Hi")
    for name in ("eos_token_id", "pad_token_id", "mask_token_id", "bos_token_id", "end_of_turn_ids"):
        assert getattr(slow, name) == getattr(dream_tok, name), name
    # older folders list their added tokens in added_tokens.json instead
    cfg = json.loads((DREAM / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = {v["content"]: int(k) for k, v in cfg.pop("added_tokens_decoder").items()}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "added_tokens.json").write_text(json.dumps(added))
    again = load_tokenizer(tmp_path)
    assert [again.encode(t) for t in DREAM_TEXTS] == [dream_tok.encode(t) for t in DREAM_TEXTS]


def test_vocab_merges_errors_are_one_line(tmp_path: Path) -> None:
    for f in ("vocab.json", "merges.txt"):
        shutil.copy(DREAM / f, tmp_path / f)
    cfg = json.loads((DREAM / "tokenizer_config.json").read_text(encoding="utf-8"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    with pytest.raises(PolestarError, match="Qwen2") as e:  # another BPE's pre-tokenizer: refused, not guessed
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)
    dec = dict(cfg["added_tokens_decoder"])
    first = min(dec, key=int)
    dec[str(int(first) + 5)] = dec.pop(first)  # an id the vocabulary cannot give
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "added_tokens_decoder": dec}))
    with pytest.raises(PolestarError, match="added token"):
        load_tokenizer(tmp_path)
    (tmp_path / "merges.txt").write_text("#version: 0.2\nnot-a-merge-line with three parts\n")
    with pytest.raises(PolestarError):
        load_tokenizer(tmp_path)


def test_dream_rebuild_is_byte_identical(tmp_path: Path) -> None:
    out = tmp_path / "tiny_dream"
    _load_builder().build_dream(str(out), seed=0)
    assert sorted(os.listdir(out)) == sorted(os.listdir(DREAM))
    for name in os.listdir(DREAM):
        assert (out / name).read_bytes() == (DREAM / name).read_bytes(), name
