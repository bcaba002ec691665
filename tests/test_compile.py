"""Compiling ahead and accounting for compile seconds (issue 31): batch buckets, ``Engine.precompile``,
``CompileRecord`` (cache hits through JAX's monitoring events), ``generate --precompile``.

The suite shares a persistent compilation cache between its processes (``conftest.py``), so the second
engine that compiles a program loads it: that is the cache hit these tests observe. The Fast-dLLM dual
cache on the bundled model keeps the compiles short.
"""
from __future__ import annotations

import dataclasses

import jax
import pytest

from polestar_jax import generate as gen_cli
from polestar_jax.cache import CompileRecord, compile_summary
from polestar_jax.config import DecodeConfig
from polestar_jax.engine import Engine, batch_bucket
from polestar_jax.errors import PolestarError

DUAL = DecodeConfig(decoder="fastdllm", cache="dual", gen_length=32, block_length=8, steps=32, threshold=0.9)
PROMPTS = ["reverse: ann,bob,cal,dan", "copy: eve,fay,gus", "sort: kat,jan,ivy"]


@pytest.fixture(scope="module")
def bundled():
    from polestar_jax.checkpoint import load_model
    from polestar_jax.tokenizer import bundled_model_dir, load_tokenizer

    cfg, params = load_model(bundled_model_dir())
    tok = load_tokenizer(bundled_model_dir())
    return cfg, params, tok


def test_batch_bucket():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 9, 33, 72)] == [1, 2, 4, 4, 8, 16, 64, 128]
    assert batch_bucket(5, limit=6) == 6 and batch_bucket(3, limit=72) == 4 and batch_bucket(9, limit=4) == 16
    # jobs of 5..8 prompts share one executable, as do 9..16
    assert len({batch_bucket(n) for n in range(5, 9)}) == 1 and len({batch_bucket(n) for n in range(9, 17)}) == 1


def test_precompile_then_a_bucketed_job_compiles_nothing(bundled):
    cfg, params, tok = bundled
    eng = Engine(params, cfg, tok)
    ids = [tok.chat_prompt_ids(p) for p in PROMPTS]
    slot = eng.prompt_slot([len(p) for p in ids])
    recs = eng.precompile(DUAL, [(4, slot)])
    assert len(recs) == 1 and isinstance(recs[0], CompileRecord) and recs[0].seconds > 0
    assert f"batch 4, prompt slot {slot}" in recs[0].what
    assert eng.precompile(DUAL, [(4, slot)]) == []  # held already: nothing compiles
    n = eng.compiles
    job = eng.generate(ids, DUAL)  # 3 prompts: a batch of 4 (row 0 copied, dropped)
    assert eng.compiles == n and job.compile_seconds == 0.0 and job.batch_size == 4 and len(job.rows) == 3
    # the bucketed rows are the rows of an exact batch of 3 (and row 0's copy changes nothing)
    exact = eng.run(ids, dataclasses.replace(DUAL, early_exit=True), prompt_slot=slot)
    for r, row in enumerate(job.rows):
        ref = exact.row(r, r)
        assert row.index == r and row.tokens.tolist() == ref.tokens.tolist() and row.nfe == ref.nfe


def test_a_second_engine_loads_from_the_persistent_cache(bundled):
    cfg, params, tok = bundled
    first = Engine(params, cfg, tok).precompile(DUAL, [(2, 48)])
    jax.clear_caches()  # (else JAX's in-memory caches answer: the engines' own programs are unaffected)
    logged = []
    second = Engine(params, cfg, tok, log=logged.append).precompile(DUAL, [(2, 48)])
    assert len(first) == len(second) == 1
    rec = second[0]
    assert rec.cache_hit, "the suite's persistent cache holds the program the first engine compiled"
    assert logged[0].startswith("compiling the fastdllm block program for batch 2, prompt slot 48")
    assert logged[1].startswith("loaded the fastdllm block program") and "tracing and lowering" in logged[1]
    assert "1 of 1 program from the compilation cache" in compile_summary(second)
    assert compile_summary([]) == ""


def test_precompile_running_batch(bundled):
    cfg, params, tok = bundled
    eng = Engine(params, cfg, tok)
    recs = eng.precompile(DUAL, [(2, 48)], running=True)
    assert [("block program" in r.what, "insertion" in r.what) for r in recs] == [(True, False), (False, True)]
    n = eng.compiles
    eng.batch(DUAL, 2, 48)  # the running batch of that shape: compiled already
    assert eng.compiles == n
    with pytest.raises(PolestarError, match="batch and a prompt slot"):
        eng.precompile(DUAL, [(0, 48)])


def test_generate_precompile_flag(capsys):
    argv = ["--decoder", "fastdllm", "--gen-length", "32", "--block-length", "8", "--precompile", "1x48,2x48"]
    assert gen_cli.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("precompiled 2 programs in ") and "from the compilation cache" in out[0]
    for bad, msg in (("2x47", "multiple of 16"), ("2by48", "BATCHxSLOT"), ("0x48", "BATCHxSLOT")):
        with pytest.raises(PolestarError, match=msg):
            gen_cli.parse_shapes(bad)
    assert gen_cli.parse_shapes("1x48, 8X64") == [(1, 48), (8, 64)]
