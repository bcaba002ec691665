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


def _answer_rows(vocab: int) -> np.ndarray:
    """[vocab] bool: the ids the fixture's LM head can predict (ASCII letters and digits, ``,.?``, the space,
    ``<|endoftext|>``, ``<|role_end|>``): answers print as text and some end at a stop token; never a mask."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    keep = [i for i, c in enumerate(alphabet) if (c.isascii() and c.isalnum()) or c in ",.?\u0120"]
    rows = np.zeros(vocab, bool)
    rows[keep + [TINY["eos_token_id"], ROLE_END]] = True
    return rows


def _weights(cfg: dict, seed: int = 15) -> dict[str, np.ndarray]:
    """Random float32 weights under the HF names of ``modeling_lladamoe.py`` (MOE_SPEC.md section 3), written
    here from the spec, independent of the package's name map: ``Linear`` weights [out, in]. Scaled so that
    the answers depend on the prompt and the position and the threshold rule commits several tokens at once
    (seed 15: the second prompt's answer ends at a stop token, the others run to the gen length)."""
    rng = np.random.default_rng(seed)
    d, h, kv, e, f, v = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                          "num_experts", "expert_intermediate_size", "vocab_size"))
    hd = d // h
    w = lambda *shape, std: (std * rng.standard_normal(shape)).astype(np.float32)
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    head = np.where(_answer_rows(v)[:, None], w(v, d, std=1.5), 0).astype(np.float32)
    out = {"model.embed_tokens.weight": w(v, d, std=1.0), "model.norm.weight": norm(d), "lm_head.weight": head}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                    p + "self_attn.q_proj.weight": w(h * hd, d, std=0.3), p + "self_attn.k_proj.weight": w(kv * hd, d, std=0.3),
                    p + "self_attn.v_proj.weight": w(kv * hd, d, std=0.3), p + "self_attn.o_proj.weight": w(d, h * hd, std=0.3),
                    p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                    p + "mlp.gate.weight": w(e, d, std=0.3)})
        for j in range(e):
            out.update({p + f"mlp.experts.{j}.{n}_proj.weight": w(*shape, std=0.2)
                        for n, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f)))})
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
    added = {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in sorted(tok.get_added_tokens_decoder().items())}
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
    (lone / "tokenizer_config.json").write_text(json.dumps({"mask_token": {"content": "<|reserved_299|>"}}))
    assert ModelConfig.from_json(str(lone)).mask_token_id == 299  # a mask token the tokenizer names wins
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


# ------------------------------------------------------------------------------------------ the faces
# They all decode with the Fast-dLLM threshold rule without a cache in a running batch of two at prompt slot 32:
# the program the continuous-batching test above compiled (the CLI's and the converted folder's engines find
# it in the session's persistent compilation cache).
FACE = "fastdllm-none"


@pytest.fixture(scope="module")
def reference(moe_model, ids):
    """The rows the faces must give: the engine's continuous job over the three chat prompts."""
    dcfg = moe_model.decode_config(**GEN, **DECODERS[FACE][0])
    return dcfg, moe_model.engine.generate(ids, dcfg, batch_size=2, prompt_slot=SLOT)


def test_convert_then_load_equals_direct_load(moe_folder, moe_model, tmp_path, capsys):
    """``python -m polestar_jax.convert`` of the sharded folder gives, loaded, the parameters of the direct
    load bit for bit (each expert's tensors stacked where the checkpoint names say), the same config (the mask id
    now written into config.json) and the tokenizer files; converted back to HF, every tensor is the source's."""
    from safetensors.numpy import load_file

    conv, back = tmp_path / "orbax", tmp_path / "hf"
    assert convert_main([str(moe_folder), str(conv)]) == 0
    assert convert_main([str(conv), str(back), "--to-hf"]) == 0
    capsys.readouterr()
    cfg, params = load_model(str(conv))
    assert cfg == moe_model.config and json.loads((conv / "config.json").read_text())["mask_token_id"] == MASK_ID
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, moe_model.params)
    src = _weights(json.loads((moe_folder / "config.json").read_text()))
    np.testing.assert_array_equal(np.asarray(params["blocks"]["e_up"][1, 3]), src["model.layers.1.mlp.experts.3.up_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(params["blocks"]["router"][0]), src["model.layers.0.mlp.gate.weight"].T)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (conv / f).read_bytes() == (moe_folder / f).read_bytes() == (back / f).read_bytes(), f
    exported = load_file(str(back / "model.safetensors"))
    assert sorted(exported) == sorted(src)
    for name, arr in src.items():
        np.testing.assert_array_equal(exported[name], arr, err_msg=name)


@pytest.mark.parametrize("converted", [False, True], ids=["hf", "converted"])
def test_generate_cli_prints_the_answers(converted, moe_folder, moe_model, reference, tmp_path, capsys):
    """``python -m polestar_jax.generate --model DIR`` (in-process main) on the HF folder and on its converted
    form: the rows of the engine's job (chat template applied), the answers printed, cut at the first stop
    token (``<|endoftext|>`` from config.json, ``<|role_end|>`` from the tokenizer)."""
    folder = moe_folder
    if converted:
        folder = tmp_path / "orbax"
        assert convert_main([str(moe_folder), str(folder)]) == 0
        capsys.readouterr()
    dcfg, job = reference
    argv = ["--model", str(folder), *sum((["--prompt", p] for p in PROMPTS), []), "--gen-length", "16",
            "--block-length", "8", "--batch-size", "2", *DECODERS[FACE][1]]
    assert gen_cli.main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["token_ids"] == [[int(t) for t in r.tokens] for r in job.rows]
    texts = [moe_model.tokenizer.decode(moe_model.engine.completion(r).response_ids) for r in job.rows]
    assert out["text"] == texts and out["decoder"] == "fastdllm" and all(texts)
    assert [moe_model.engine.completion(r).finish_reason for r in job.rows] == ["length", "stop", "length"]
    for r, text in zip(job.rows, texts):
        resp = moe_model.engine.completion(r).response_ids
        assert not {301, ROLE_END} & set(resp) and [int(t) for t in r.tokens[:len(resp)]] == resp
        assert f"\n{text}\n" in f"\n{captured.err}\n"  # the answers are printed (on stderr beside --json)


def test_python_api(moe_model, reference):
    """``load(DIR).generate(prompts, ...)``: the chat-rendered prompts, the job's rows and their texts."""
    dcfg, job = reference
    gens = moe_model.generate(PROMPTS, batch_size=2, **GEN, **DECODERS[FACE][0])
    assert gens.decode == dcfg and gens.batches == 2
    for g, r in zip(gens, job.rows):
        c = moe_model.engine.completion(r)
        assert g.token_ids == [int(t) for t in r.tokens] and g.response_ids == c.response_ids
        assert g.text == moe_model.tokenizer.decode(c.response_ids) and g.nfe == r.nfe


def test_openai_server_answers_a_chat_request(moe_folder, moe_model):
    """The OpenAI-compatible app with the scheduler the server builds (``serve.py``: a sampling running batch),
    spoken to with the real ``openai`` client: a chat request comes back with the answer the prompt gets alone
    (temperature 0), under the folder's name."""
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient

    from polestar_jax.serving.app import ServerLimits, create_app
    from polestar_jax.serving.scheduler import Scheduler

    dcfg = moe_model.decode_config(**GEN, **DECODERS[FACE][0])
    name = moe_folder.name
    scheduler = Scheduler(moe_model.engine, dcfg, 2, SLOT, sampling=True).start()
    try:
        with TestClient(create_app(moe_model, scheduler, ServerLimits(SLOT, 16, 8), name)) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
            r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPTS[2]}],
                                               max_tokens=16, temperature=0)
    finally:
        scheduler.stop()
    alone = moe_model.engine.completion(_alone(moe_model, moe_model.prompt_ids(PROMPTS[2]), dcfg, 0))
    assert r.choices[0].message.content == moe_model.tokenizer.decode(alone.response_ids)
    assert r.model == name and r.usage.prompt_tokens == len(moe_model.prompt_ids(PROMPTS[2]))
    assert r.choices[0].finish_reason == alone.finish_reason


def test_lm_eval_model_generates_with_the_chat_template(moe_model, reference):
    """lm-eval's model class on the folder: ``generate_until`` requests whose contexts lm-eval renders with our
    chat template (``apply_chat_template``) decode as one continuous job of two rows and return the job's texts."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from polestar_jax.lm_eval_model import PolestarLM

    _, job = reference
    lm = PolestarLM(model_obj=moe_model, batch_size=2, pad_multiple=SLOT, gen_length=16, block_length=8,
                    progress=False, **DECODERS[FACE][0])
    ctxs = [lm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    reqs = [Instance("generate_until", {}, (c, {"until": [], "max_gen_toks": 16}), i, metadata=("moe", i, 1))
            for i, c in enumerate(ctxs)]
    texts = lm.generate_until(reqs)
    assert texts == [moe_model.tokenizer.decode(moe_model.engine.completion(r).response_ids) for r in job.rows]
    assert len(lm.batches) == 1 and lm.batches[0]["rows"] == 2 and lm.batches[0]["prompt_slot"] == SLOT
