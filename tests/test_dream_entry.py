"""Dream through every entry point: the converter (HF <-> orbax, single and sharded bf16, bit-exact), the
generate CLI (batched, every decoder, Dream's Polestar defaults), the text API on HF and converted folders, the
lm-eval model (generation and log-likelihoods) and ``python -m polestar_jax.eval`` on the local task.

Model: the bundled random ``polestar_jax/assets/tiny_dream`` (bench/make_tiny_random.py --family dream), loaded
once; the converter also takes the golden ``tests/data/dream_tiny_a`` weights cast to bf16. One prompt pair and
one length setting (gen 16, block 8) throughout, so each decoder compiles once for the whole file (the CLI
runs, in-process and as a subprocess, reuse the session's compile cache).
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from polestar_jax import api
from polestar_jax.engine import engine
from polestar_jax import generate as gen_cli
from polestar_jax.io.checkpoint import load_model, params_dtype
from polestar_jax.config import PolestarConfig
from polestar_jax.convert.__main__ import main as convert_main
from polestar_jax.models.family import FAMILIES
from polestar_jax.io.tokenizer import asset_model_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
TINY_DREAM = asset_model_dir("tiny_dream")
LOCAL = DATA / "eval_local"
#: the first two documents of the local eval task: the API / CLI prompts here and the eval's --limit 2 rows
PROMPTS = [json.loads(line)["prompt"] for line in open(LOCAL / "polestar_local.jsonl")][:2]
GEN = ["--gen-length", "16", "--block-length", "8"]
DECODERS = {  # name -> (API knobs, CLI flags)
    "llada": ({"decoder": "llada"}, ["--decoder", "llada"]),
    "fastdllm-none": ({"decoder": "fastdllm", "cache": "none"}, ["--decoder", "fastdllm", "--cache", "none"]),
    "fastdllm-prefix": ({"decoder": "fastdllm", "cache": "prefix"}, ["--decoder", "fastdllm", "--cache", "prefix"]),
    "fastdllm-dual": ({"decoder": "fastdllm", "cache": "dual"}, ["--decoder", "fastdllm", "--cache", "dual"]),
    "polestar": ({}, []),
}


pytestmark = pytest.mark.usefixtures("offline_session_cache")


@pytest.fixture(scope="module")
def tiny_dream():
    return api.load(TINY_DREAM, compile_cache=False)


# ------------------------------------------------------------------------------------------- converter
# safetensors files written and read byte by byte here (the format: 8-byte little-endian header size, a JSON
# header {name: {dtype, shape, data_offsets}}, the data), independent of the package's reader and writer.

def _write_raw(path: Path, tensors: dict[str, tuple[str, tuple, bytes]]) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(d for _, _, d in tensors.values()))


def _read_raw(folder: Path) -> dict[str, tuple[str, tuple, bytes]]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        blob = f.read_bytes()
        n = struct.unpack("<Q", blob[:8])[0]
        header = json.loads(blob[8:8 + n])
        header.pop("__metadata__", None)
        for name, h in header.items():
            a, b = h["data_offsets"]
            assert name not in out, name
            out[name] = (h["dtype"], tuple(h["shape"]), blob[8 + n + a:8 + n + b])
    return out


def _bf16_dream_folder(folder: Path, shards: int) -> dict[str, tuple[str, tuple, bytes]]:
    """dream_tiny_a's weights rounded to bfloat16 as an HF folder of ``shards`` safetensors files (with
    ``model.safetensors.index.json`` when sharded), its config.json saying torch_dtype bfloat16."""
    folder.mkdir(parents=True)
    f32 = load_file(str(DATA / "dream_tiny_a" / "model.safetensors"))
    tensors = {k: ("BF16", v.shape, v.astype(ml_dtypes.bfloat16).tobytes()) for k, v in f32.items()}
    config = json.loads((DATA / "dream_tiny_a" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    names = list(tensors)
    if shards == 1:
        _write_raw(folder / "model.safetensors", tensors)
        return tensors
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    parts = np.array_split(np.arange(len(names)), shards)
    weight_map = {}
    for fname, idx in zip(files, parts):
        _write_raw(folder / fname, {names[i]: tensors[names[i]] for i in idx})
        weight_map.update({names[i]: fname for i in idx})
    total = sum(len(d) for _, _, d in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return tensors


@pytest.mark.parametrize("shards", [1, 3])
def test_convert_bf16_dream_round_trip_is_bit_exact(tmp_path, shards, capsys):
    """HF (Qwen2 names, bf16, single file or 3 shards + index) -> orbax -> HF: every tensor's bytes, dtype and
    shape come back; the converted folder loads as the HF one (bf16, bit for bit); config.json keeps its fields."""
    src, conv, back = tmp_path / "hf", tmp_path / "orbax", tmp_path / "back"
    tensors = _bf16_dream_folder(src, shards)
    assert convert_main([str(src), str(conv)]) == 0
    assert f"converted {len(tensors)} tensors" in capsys.readouterr().out
    cfg_hf, p_hf = load_model(src)
    cfg_conv, p_conv = load_model(conv)
    assert cfg_conv == cfg_hf and cfg_conv.family == "dream" and params_dtype(p_conv) == "bfloat16"
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p_hf), jax.tree.leaves(p_conv)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)), path
    shard_flags = ["--max-shard-mb", "0.15"] if shards > 1 else []
    assert convert_main(["--to-hf", str(conv), str(back), *shard_flags]) == 0
    again = _read_raw(back)
    assert again.keys() == tensors.keys()
    for name, (dtype, shape, data) in tensors.items():
        assert again[name] == (dtype, shape, data), name
    assert (back / "model.safetensors.index.json").is_file() == (shards > 1)
    if shards > 1:
        assert len(list(back.glob("model-*-of-*.safetensors"))) > 1
    src_cfg, back_cfg = (json.loads((d / "config.json").read_text()) for d in (src, back))
    assert {k: back_cfg.get(k) for k in src_cfg} == src_cfg  # every source field (bos id, ...) survives


def test_converted_tiny_dream_generates_as_the_hf_folder(tmp_path, tiny_dream):
    """The converter carries the tokenizer files over (vocab.json, merges.txt, ...); the text API on the
    converted folder decodes exactly what it decodes on the HF folder."""
    conv = tmp_path / "tiny_dream_orbax"
    assert convert_main([TINY_DREAM, str(conv)]) == 0
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json",
              "special_tokens_map.json"):
        assert (conv / f).read_bytes() == (Path(TINY_DREAM) / f).read_bytes(), f
    other = api.load(str(conv), compile_cache=False)
    assert other.config == tiny_dream.config and other.tokenizer.chat_template == tiny_dream.tokenizer.chat_template
    a = tiny_dream.generate(PROMPTS, gen_length=16, block_length=8)
    b = other.generate(PROMPTS, gen_length=16, block_length=8)
    assert [r.token_ids for r in a] == [r.token_ids for r in b] and a.texts == b.texts


# ------------------------------------------------------------------------------------------- generate CLI

def test_generate_cli_takes_dream_polestar_defaults():
    """No Polestar flag: decoder polestar on a Dream folder runs Dream's official Polestar parameters, as the
    API does; a knob given overrides only itself; other decoders and LLaDA folders keep the plain defaults."""
    fam = FAMILIES["dream"]

    def cli(*argv, family="dream"):
        args = gen_cli.build_parser().parse_args(["--model", TINY_DREAM, "--prompt", "x", *argv])
        return gen_cli.decode_config_from_args(args, {}, family)

    assert cli().polestar == fam.polestar_config() == api.decode_config({}, family="dream").polestar
    assert cli().polestar.full_prefix_rows == 64 and cli().polestar.proxy_score == "mean"
    assert cli("--top-k", "2").polestar == fam.polestar_config(top_k=2) == \
        api.decode_config({}, family="dream", top_k=2).polestar
    assert cli("--full-prefix-rows", "16").polestar.full_prefix_rows == 16
    assert cli("--decoder", "fastdllm").polestar == PolestarConfig()
    assert cli(family="llada").polestar == PolestarConfig() == cli(family=None).polestar


@pytest.mark.parametrize("name", list(DECODERS))
def test_generate_cli_batched_every_decoder(name, tiny_dream, capsys, monkeypatch):
    """``python -m polestar_jax.generate --model tiny_dream`` (in-process main) with two prompts: exit 0, each
    row's ids are the API's, the response is cut at EOS / <|im_end|>; the engine got Dream's Polestar config."""
    knobs, flags = DECODERS[name]
    seen = []
    real = engine.Engine.generate
    monkeypatch.setattr(engine.Engine, "generate", lambda self, *a, **k: (seen.append(a[1]), real(self, *a, **k))[1])
    argv = ["--model", TINY_DREAM, *sum((["--prompt", p] for p in PROMPTS), []), *GEN, *flags, "--json"]
    assert gen_cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)  # stdout: one JSON document
    ref = tiny_dream.generate(PROMPTS, gen_length=16, block_length=8, **knobs)
    assert seen[0] == ref.decode
    if name == "polestar":
        assert seen[0].polestar == FAMILIES["dream"].polestar_config()
        assert len(out["refresh_steps"]) == 2
    assert out["token_ids"] == [r.token_ids for r in ref] and out["text"] == ref.texts
    assert out["nfe"] == [r.nfe for r in ref]
    stops = {tiny_dream.config.eos_token_id, tiny_dream.tokenizer.token_to_id("<|im_end|>")}
    for r in ref:
        assert len(r.token_ids) == 16 and not stops & set(r.response_ids)
        assert r.token_ids[:len(r.response_ids)] == r.response_ids
        assert r.text == tiny_dream.tokenizer.decode(r.response_ids)
        if name == "llada":
            assert r.nfe == 16  # steps = gen length: one token per forward


def test_generate_cli_subprocess(subprocess_env):
    """The command as a user types it, on the bundled Dream folder (no persistent compile cache)."""
    cmd = [sys.executable, "-m", "polestar_jax.generate", "--model", "polestar_jax/assets/tiny_dream",
           "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], *GEN, "--json"]
    env = dict(subprocess_env, POLESTAR_JAX_CACHE="off",
               JAX_DEFAULT_MATMUL_PRECISION="highest")  # as this session (conftest): the same numbers
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["text"]) == 2 and out["decoder"] == "polestar" and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------- eval

def test_eval_local_task_on_tiny_dream(tiny_dream, tmp_path, capsys):
    """``python -m polestar_jax.eval --model tiny_dream`` on the local task (2 documents, one batch): results
    and samples written, lm-eval's chat prompts are our template's, each response is the API's for the same
    ids and row, and the decoder recorded is Dream's Polestar."""
    pytest.importorskip("lm_eval")
    from polestar_jax import eval as ev

    out = tmp_path / "eval"
    argv = ["--model", TINY_DREAM, "--tasks", "polestar_local", "--include-path", str(LOCAL),
            "--apply-chat-template", "--limit", "2", "--batch-size", "2", *GEN, "--bootstrap-iters", "0",
            "--no-progress", "--output-path", str(out), "--json"]
    assert ev.main(argv) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    results = json.loads((out / "results.json").read_text())
    samples = sorted((json.loads(line) for line in open(out / "samples_polestar_local.jsonl")),
                     key=lambda s: s["doc_id"])
    assert [s["doc"]["prompt"] for s in samples] == PROMPTS
    assert results["polestar_jax"]["decoder"]["polestar"] == json.loads(json.dumps(
        dataclasses.asdict(FAMILIES["dream"].polestar_config())))
    assert last["polestar_jax"]["total"]["requests"] == 2
    dcfg = tiny_dream.decode_config(gen_length=16, block_length=8)
    ids = [tiny_dream.tokenizer.chat_prompt_ids(p) for p in PROMPTS]
    slot = 16 * math.ceil(max(map(len, ids)) / 16)
    assert {16 * math.ceil(len(i) / 16) for i in ids} == {slot}  # one request group: one batch of 2
    ref = tiny_dream.generate_ids(ids, dcfg, rows=[0, 1], prompt_slot=slot)
    for s, r in zip(samples, ref):
        assert s["resps"][0][0] == r.text
        assert [rec["nfe"] for rec in s["polestar_jax"]] == [r.nfe]
        assert s["polestar_jax"][0]["prompt_tokens"] == len(ids[s["doc_id"]])


def test_lm_eval_loglikelihood_uses_dream_logits(tiny_dream):
    """A one-token continuation: every Monte-Carlo copy masks it, so the estimate is exactly log p(token) at
    that position under Dream's forward with its logit shift (row p-1 predicts p), computed here from the
    crosscheck's raw family logits."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from polestar_jax import crosscheck
    from polestar_jax.lm_eval_model import PolestarLM

    lm = PolestarLM(model_obj=tiny_dream, mc_num=2, mc_batch=2, progress=False)
    ctx = tiny_dream.tokenizer.apply_chat_template([{"role": "user", "content": "Name a letter."}]) + "The letter is"
    prefix, target = lm._encode_pair(ctx, " a")
    assert len(target) == 1 and prefix == tiny_dream.tokenizer.encode(ctx)
    (ll, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, " a"), 0, metadata=("ll", 0, 1))])
    n = len(prefix) + 1
    ids = np.full((1, 16 * math.ceil(n / 16)), tiny_dream.config.pad_token_id, np.int32)
    ids[0, :n] = prefix + [tiny_dream.config.mask_token_id]
    raw, _ = crosscheck.family_logits(tiny_dream.params, jax.numpy.asarray(ids[:, :n]), tiny_dream.config)
    row = np.asarray(raw[0, n - 2], np.float64)  # shifted: position n-1 is predicted by row n-2
    want = row[target[0]] - (np.log(np.sum(np.exp(row - row.max()))) + row.max())
    assert ll == pytest.approx(want, abs=2e-5) and greedy is False
