"""LLaDA-MoE through every entry point, on a tiny HF folder laid out as LLaDA-MoE-7B-A1B-Instruct ships
(issue #45 item 5): the mask id from the folder's tokenizer (its config.json has none), eos from config.json,
the chat template from tokenizer_config.json; the converter (convert then load == direct load), the generate
command, the text API, the OpenAI server (the real ``openai`` client) and the lm-eval model. Every decoder runs in
the engine's continuous batching, each row giving the tokens it gets alone (item 3).

The folder (module fixture, written here): ``config.json`` is the real checkpoint's (``llada_moe_7b_a1b``)
with tiny shapes; random weights under the checkpoint's tensor names in two safetensors shards with
``model.safetensors.index.json``; a byte-level ``tokenizer.json`` whose ``<|endoftext|>`` sits at the
config's eos id and whose ``<|mask|>`` is not the last id; a Ling-style chat template (``<role>HUMAN</role>``
... ``<|role_end|>``). One prompt set and one length setting throughout (gen 16, block 8, prompt slot 32), so
each decoder compiles its running batch and its batch of one once.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from polestar_jax import api
from polestar_jax import generate as gen_cli
from polestar_jax.config import ModelConfig
from polestar_jax.convert.__main__ import main as convert_main
from polestar_jax.errors import ConfigError
from polestar_jax.io.checkpoint import load_model
from polestar_jax.io.safetensors_io import write_safetensors

DATA = Path(__file__).resolve().parent / "data"
REAL_CONFIG = DATA / "llada_moe_7b_a1b" / "config.json"
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "expert_intermediate_size": 32, "dense_intermediate_size": 128,
        "moe_layer_freq": [1, 1], "vocab_size": 320, "eos_token_id": 301, "pad_token_id": 301,
        "torch_dtype": "float32"}
#: the tokenizer's special tokens past the 256 byte symbols (reserved fillers between): eos at the config's id
SPECIALS = {300: "<|startoftext|>", TINY["eos_token_id"]: "<|endoftext|>", 303: "<role>", 304: "</role>",
            305: "<|role_end|>", 306: "<|mask|>"}
MASK_ID, ROLE_END = 306, 305
TEMPLATE = ("{%- for message in messages -%}{%- set role = message['role'] | upper -%}"
            "{%- if role == 'USER' -%}{%- set role = 'HUMAN' -%}{%- endif -%}"
            "{{ '<role>' + role + '</role>' + message['content'] + '<|role_end|>' }}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{ '<role>ASSISTANT</role>' }}{%- endif -%}")
PROMPTS = ["12*7?", "Hi!", "Name a color"]  # 24, 22 and 31 prompt tokens with the template
GEN = dict(gen_length=16, block_length=8)
SLOT = 32
DECODERS = {  # name -> (API knobs, CLI flags)
    "llada": ({"decoder": "llada"}, ["--decoder", "llada"]),
    "fastdllm-none": ({"decoder": "fastdllm", "cache": "none"}, ["--decoder", "fastdllm", "--cache", "none"]),
    "fastdllm-prefix": ({"decoder": "fastdllm", "cache": "prefix"}, ["--decoder", "fastdllm", "--cache", "prefix"]),
    "fastdllm-dual": ({"decoder": "fastdllm", "cache": "dual"}, ["--decoder", "fastdllm", "--cache", "dual"]),
    # (one refresh width, no window-only passes: Polestar's shortest compile, bench_compile's polestar-lean)
    "polestar": ({"refresh_buckets": 1, "windowed_period": 0}, ["--refresh-buckets", "1", "--windowed-period", "0"]),
}

pytestmark = pytest.mark.usefixtures("offline_session_cache")


def _tokenizer() -> Tokenizer:
    """Byte-level BPE without merges (one id per byte), then :data:`SPECIALS` at their ids."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    for i in range(len(alphabet), max(SPECIALS) + 1):
        tok.add_special_tokens([AddedToken(SPECIALS.get(i, f"<|reserved_{i}|>"), special=True, normalized=False)])
    assert all(tok.token_to_id(t) == i for i, t in SPECIALS.items())
    return tok


def _weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under the HF names of ``modeling_lladamoe.py`` (MOE_SPEC.md section 3), written
    here from the spec, independent of the package's name map: ``Linear`` weights [out, in]."""
    rng = np.random.default_rng(seed)
    d, h, kv, e, f, v = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                          "num_experts", "expert_intermediate_size", "vocab_size"))
    hd = d // h
    w = lambda *shape, std=0.05: (std * rng.standard_normal(shape)).astype(np.float32)
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    out = {"model.embed_tokens.weight": w(v, d, std=1.0), "model.norm.weight": norm(d),
           "lm_head.weight": w(v, d, std=0.3)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                    p + "self_attn.q_proj.weight": w(h * hd, d), p + "self_attn.k_proj.weight": w(kv * hd, d),
                    p + "self_attn.v_proj.weight": w(kv * hd, d), p + "self_attn.o_proj.weight": w(d, h * hd),
                    p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                    p + "mlp.gate.weight": w(e, d, std=0.3)})
        for j in range(e):
            out.update({p + f"mlp.experts.{j}.gate_proj.weight": w(f, d), p + f"mlp.experts.{j}.up_proj.weight": w(f, d),
                        p + f"mlp.experts.{j}.down_proj.weight": w(d, f)})
    return out


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> Path:
    """The tiny LLaDA-MoE-7B-A1B-Instruct-like HF folder (module docstring)."""
    folder = tmp_path_factory.mktemp("llada_moe_instruct")
    cfg = {**json.loads(REAL_CONFIG.read_text()), **TINY}
    assert "mask_token_id" not in cfg  # as the real config.json
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = _weights(cfg)
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, part in shards.items():
        write_safetensors(folder / fname, {n: weights[n] for n in part}, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(a.nbytes for a in weights.values())},
         "weight_map": {n: fname for fname, part in shards.items() for n in part}}))
    tok = _tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in sorted(tok.get_added_tokens_decoder().items())
             for t in [t.content]}
    (folder / "tokenizer_config.json").write_text(json.dumps(  # no mask_token named, as the real one
        {"added_tokens_decoder": added, "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
         "pad_token": "<|endoftext|>", "chat_template": TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"],
                                                               "pad_token_id": cfg["pad_token_id"]}))
    return folder


@pytest.fixture(scope="module")
def moe_model(moe_folder):
    return api.load(str(moe_folder), compile_cache=False)


@pytest.fixture(scope="module")
def ids(moe_model):
    return [moe_model.prompt_ids(p) for p in PROMPTS]


# ----------------------------------------------------------------------------------- folder, tokenizer
def test_ids_and_chat_template_come_from_the_folder(moe_folder, moe_model, tmp_path):
    """The mask id is the tokenizer's ``<|mask|>`` (config.json has none; nothing is assumed), eos / pad are
    config.json's; the tokenizer (tokenizer.json through the tokenizers library) agrees; ``<|role_end|>`` ends a
    response; the chat template of tokenizer_config.json renders the Ling turn format (a chat_template.jinja
    beside it takes precedence, as in transformers). Without any tokenizer file the mask id is a one-line error."""
    cfg, tok = moe_model.config, moe_model.tokenizer
    assert cfg.family == "llada_moe" and (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (MASK_ID, 301, 301)
    assert cfg.mask_token_id != cfg.vocab_size - 1 and cfg.n_kv_heads == 2
    assert (tok.mask_token_id, tok.eos_token_id, tok.pad_token_id) == (MASK_ID, 301, 301)
    assert tok.end_of_turn_ids == {ROLE_END} and moe_model.stop_ids == {301, ROLE_END}
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<role>SYSTEM</role>Be brief.<|role_end|><role>HUMAN</role>Hi<|role_end|><role>ASSISTANT</role>"
    got = tok.chat_prompt_ids("Hi")
    assert got[0] == 303 and got[-1] == 304 and got.count(ROLE_END) == 1  # the markup: one id each
    assert tok.decode(got, skip_special_tokens=False).endswith("Hi<|role_end|><role>ASSISTANT</role>")
    lone = tmp_path / "config_only"
    lone.mkdir()
    (lone / "config.json").write_bytes((moe_folder / "config.json").read_bytes())
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_json(str(lone))
    assert "mask_token_id" in str(e.value) and "<|mask|>" in str(e.value) and len(str(e.value).splitlines()) == 1
    (lone / "tokenizer.json").write_bytes((moe_folder / "tokenizer.json").read_bytes())  # tokenizer.json alone
    assert ModelConfig.from_json(str(lone)).mask_token_id == MASK_ID
    (lone / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    from polestar_jax.io.tokenizer import load_tokenizer

    assert load_tokenizer(lone).apply_chat_template([{"role": "user", "content": "Hi"}]) == "Hi!"


# ------------------------------------------------------------------------------ continuous batching
def _alone(model, prompt: list[int], dcfg, row: int):
    """``prompt`` decoded alone: the only row of the same running batch (its other slot free)."""
    batch = model.engine.batch(dcfg, 2, SLOT)
    batch.insert(prompt, seed=0, row=row, tag=row, gen_length=dcfg.gen_length)
    done = []
    while batch.occupied:
        batch.step()
        done += batch.finished()
    return done[0]


@pytest.mark.parametrize("name", [n for n in DECODERS if n != "fastdllm-dual"])
def test_every_decoder_in_continuous_batching_gives_each_row_alone(name, moe_model, ids):
    """Three prompts of different lengths through a running batch of two slots (the third is inserted when a
    slot frees, at a later block, next to a row in mid-decode): each row's tokens, commits and NFE equal its
    decode alone; every position is decided. (The dual cache: tests/test_llada_moe.py, against the fixed
    batch.)"""
    knobs, _ = DECODERS[name]
    dcfg = moe_model.decode_config(**GEN, **knobs)
    job = moe_model.engine.generate(ids, dcfg, batch_size=2, prompt_slot=SLOT)
    assert job.batch_size == 2 and job.block_calls > 2  # (three rows of two blocks in two slots)
    for i, row in enumerate(job.rows):
        alone = _alone(moe_model, ids[i], dcfg, i)
        for field in ("tokens", "commit_step", "block_nfe"):
            np.testing.assert_array_equal(getattr(row, field), getattr(alone, field), err_msg=f"{name} {i} {field}")
        assert row.nfe == alone.nfe and MASK_ID not in row.tokens
