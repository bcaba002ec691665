"""The text API (:mod:`polestar_jax.api`): the README's "From Python" snippet runs as written; results equal the
engine's and the CLI's accounting; batching does not change a row; decoder settings follow the CLI's rules;
the persistent compile cache is on unless opted out.

Shapes are shared with other files: the README snippet's 4-prompt Polestar batch at slot 64 is
tests/test_options.py's, the checked dual cache at batch 7 / 1 and slot 64 is tests/test_bench_run.py's.
"""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from bench import tasks as T
from polestar_jax import api
from polestar_jax import generate as gen_cli
from polestar_jax.config import DecodeConfig, PolestarConfig
from polestar_jax.errors import PolestarError

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _session_cache(monkeypatch):
    """load() turns on the persistent cache unless told: off here (never the user's; see conftest.py)."""
    monkeypatch.setenv("POLESTAR_JAX_CACHE", "off")
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)  # enable_compile_cache sets 0.5


def _readme_snippet() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("From Python", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "no python block after 'From Python' in README.md"
    return m.group(1)


def test_readme_snippet_runs_as_written():
    code = _readme_snippet()
    ns: dict = {}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - the README's own example
    out, model = ns["out"], ns["model"]
    lines = buf.getvalue().splitlines()
    assert len(lines) == len(ns["prompts"]) + 1 and "tokens/s" in lines[-1]
    assert len(out) == len(ns["prompts"]) and out.decode.decoder == "polestar"
    gen, block = model.defaults["gen_length"], model.defaults["block_length"]
    assert (out.decode.gen_length, out.decode.block_length) == (gen, block)
    for i, r in enumerate(out):
        # early exit: the decoded blocks only (every block when the response runs to the end)
        assert r.row == i and r.prompt == ns["prompts"][i] and len(r.token_ids) % block == 0
        assert len(r.token_ids) == gen or r.finish_reason == "stop"
        assert isinstance(r.text, str) and r.nfe > 0 and r.tpf == pytest.approx(r.non_eos_tokens / r.nfe)
        assert set(r.stats) == {"refresh_steps", "early_commits", "suffix_commits", "windowed_passes"}
        assert r.tps == out.tps  # one batch
    assert out.rows[1].text == "gus,hal,ivy"  # the trained model copies
    assert out.tpf == pytest.approx(out.non_eos_tokens / out.nfe) and out.tps > 0
    # load() keeps the process's setting of JAX's persistent cache (here none: the suite runs with
    # POLESTAR_JAX_CACHE=off; tests/test_compile.py and the rerun test below use folders of their own)
    assert model.compile_cache_dir == jax.config.jax_compilation_cache_dir


@pytest.fixture(scope="module")
def tiny():
    return api.load(compile_cache=False)


def _local_prompts():
    return [p for t in ("copy", "sort", "add") for p, _ in T.eval_instances(t, 3)]


CHECKED = dict(decoder="fastdllm", cache="dual", step_after_full_pass=False)  # bench.run's fastdllm-dual-checked


def test_generate_matches_engine_and_batching(tiny):
    """Text API = engine on the chat-template ids; batch 7 (two batches, the last padded) = batch 1 = one
    batch of all 9 would be; the counts are bench.run's (non-EOS tokens / NFE)."""
    from engines import generate  # tests/engines.py

    prompts = _local_prompts()
    a = tiny.generate(prompts, batch_size=7, **CHECKED)
    b = tiny.generate(prompts, batch_size=1, **CHECKED)
    assert a.batches == 2 and b.batches == 9
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [(r.nfe, r.text, r.row) for r in a] == [(r.nfe, r.text, r.row) for r in b]
    ids = [tiny.tokenizer.chat_prompt_ids(p) for p in prompts[:7]]
    ref = generate(tiny.params, tiny.config, ids, a.decode, prompt_slot=64, early_exit=True)
    for i, r in enumerate(list(a)[:7]):  # early exit: each row's decoded blocks
        np.testing.assert_array_equal(r.token_ids, ref.row(i).tokens)
    eos = {tiny.config.eos_token_id, tiny.config.pad_token_id}
    for r, toks in zip(a, [ref.row(i).tokens for i in range(7)]):
        assert r.non_eos_tokens == sum(1 for t in toks if t not in eos)
        assert r.text == T.decode_answer(tiny.tokenizer, toks)  # bench.run's answer text
    assert a.non_eos_tokens == sum(r.non_eos_tokens for r in a) and a.nfe == sum(r.nfe for r in a)
    d = a.to_dict()
    assert d["tpf"] == a.tpf and len(d["rows"]) == 9 and d["decoder"] == "fastdllm"


def _cli_config(argv: list[str], defaults: dict) -> DecodeConfig:
    args = gen_cli.build_parser().parse_args(["--prompt", "x", *argv])
    return gen_cli.decode_config_from_args(args, defaults)


@pytest.mark.parametrize("knobs, argv", [
    ({}, []),
    ({"decoder": "llada"}, ["--decoder", "llada"]),
    ({"decoder": "fastdllm", "cache": "prefix", "threshold": 0.8}, ["--decoder", "fastdllm", "--cache", "prefix",
                                                                     "--threshold", "0.8"]),
    ({"decoder": "fastdllm", "threshold": None, "steps": 16}, ["--decoder", "fastdllm", "--threshold", "none",
                                                               "--steps", "16"]),
    ({"decoder": "fastdllm", "factor": 1.0}, ["--decoder", "fastdllm", "--factor", "1.0"]),
    ({"gen_length": 16}, ["--gen-length", "16"]),
    ({"gen_length": 64, "block_length": 16, "top_k": 2, "early_threshold": None},
     ["--gen-length", "64", "--block-length", "16", "--top-k", "2", "--early-threshold", "none"]),
])
def test_decode_config_is_the_clis(knobs, argv):
    defaults = {"gen_length": 32, "block_length": 8}
    assert api.decode_config(defaults, **knobs) == _cli_config(argv, defaults)
    assert api.decode_config({}, **knobs) == _cli_config(argv, {})


def test_decode_config_errors_are_one_line(tiny):
    cases = [
        (dict(bogus=1), "unknown decoder setting"),
        (dict(decoder="fastdllm", top_k=2), "decoder polestar only"),
        (dict(decoder="fastdllm", steps=8), "fixed schedule"),
        (dict(top_k="two"), "top_k must be an integer"),
        (dict(threshold="high"), "threshold must be a number"),
        (dict(gen_length=30), "not a multiple"),
        (dict(polestar=PolestarConfig(top_k=2), top_k=3), "not both"),
    ]
    for knobs, needle in cases:
        with pytest.raises(PolestarError) as e:
            api.decode_config({"gen_length": 32, "block_length": 8}, **knobs)
        assert needle in str(e.value) and "\n" not in str(e.value), (knobs, str(e.value))
    for prompts, needle in (([], "no prompt"), ([""], "prompt 0 is empty"), ([3], "not a string")):
        with pytest.raises(PolestarError, match=needle):
            tiny.generate(prompts)
    with pytest.raises(PolestarError, match="not found"):
        api.load("/nonexistent/model")
    assert api.decode_config(polestar=PolestarConfig(top_k=2)).polestar.top_k == 2


_RERUN = """
import jax, sys
from polestar_jax.api import load
model = load()
out = model.generate(["copy: ann,bob,cal"], decoder="llada", gen_length=8)
print(model.compile_cache_dir, jax.config.jax_compilation_cache_dir, out.texts[0] != "",
      sorted({r.from_store for r in model.engine.compile_records}))
"""


def test_load_reruns_load_from_the_executable_store(subprocess_env, tmp_path):
    """A script's rerun loads its programs from the executable store (nothing traced), as the command lines'
    reruns do: load() turns the cache on by default; POLESTAR_JAX_CACHE=off leaves JAX's settings alone."""
    import subprocess
    import sys

    env = {k: v for k, v in subprocess_env.items() if not k.startswith("JAX_") or k == "JAX_PLATFORMS"}
    env.update(POLESTAR_JAX_CACHE=str(tmp_path / "cc"), JAX_DEFAULT_MATMUL_PRECISION="highest")

    def rerun(**more):
        r = subprocess.run([sys.executable, "-c", _RERUN], cwd=REPO_ROOT, env=dict(env, **more), capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.split()

    folder = str(tmp_path / "cc")
    assert rerun() == [folder, folder, "True", "[False]"]  # compiled, stored
    assert rerun() == [folder, folder, "True", "[True]"]  # the rerun: every program from the store
    assert rerun(POLESTAR_JAX_CACHE="off") == ["None", "None", "True", "[False]"]


def test_compile_cache_opt_out(monkeypatch, tmp_path):
    monkeypatch.setenv("POLESTAR_JAX_CACHE", "off")
    assert api.load().compile_cache_dir is None
    assert api.load(compile_cache=False).compile_cache_dir is None
    from polestar_jax.engine import compile_cache as cache

    assert cache.cache_folder() is None
    monkeypatch.setenv("POLESTAR_JAX_CACHE", str(tmp_path / "cc"))
    assert cache.cache_folder() == str(tmp_path / "cc")
    assert gen_cli.enable_compile_cache is cache.enable_compile_cache  # generate keeps the name

