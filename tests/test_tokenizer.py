"""Tokenizer loading, encode/decode, the LLaDA chat template, and the bundled models (tiny_tasks, tiny_random)."""
from __future__ import annotations

import importlib.resources
import importlib.util
import json
import os
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from polestar_jax.config import ModelConfig
from polestar_jax.errors import PolestarError
from polestar_jax.tokenizer import Tokenizer, asset_model_dir, bundled_model_dir, load_tokenizer

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
    from polestar_jax.checkpoint import generation_defaults

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
