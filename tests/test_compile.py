"""Compiling ahead and accounting for compile seconds (issue 31): batch buckets, ``Engine.precompile``,
``CompileRecord`` (cache hits through JAX's monitoring events), ``generate --precompile``.

Each test here has a persistent compilation cache of its own (the suite runs without one: ``conftest.py``),
so the second engine that compiles a program loads it: that is the cache hit these tests observe. The
Fast-dLLM dual cache on the bundled model keeps the compiles short.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import pytest
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from polestar_jax.engine import executables
from polestar_jax import generate as gen_cli
from polestar_jax.engine.compile_cache import CompileRecord, compile_summary
from polestar_jax.config import DecodeConfig
from polestar_jax.engine.engine import Engine, batch_bucket
from polestar_jax.errors import PolestarError

DUAL = DecodeConfig(decoder="fastdllm", cache="dual", gen_length=32, block_length=8, steps=32, threshold=0.9)
PROMPTS = ["reverse: ann,bob,cal,dan", "copy: eve,fay,gus", "sort: kat,jan,ivy"]


@pytest.fixture(scope="module")
def bundled():
    from polestar_jax.io.checkpoint import load_model
    from polestar_jax.io.tokenizer import bundled_model_dir, load_tokenizer

    cfg, params = load_model(bundled_model_dir())
    tok = load_tokenizer(bundled_model_dir())
    return cfg, params, tok


@pytest.fixture(autouse=True)
def own_persistent_cache(tmp_path):
    """JAX's persistent compilation cache in a folder of this test's (every program written); turned off
    after the test (``conftest.no_persistent_cache_left_on``)."""
    names = ("jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes",
             "jax_enable_compilation_cache")
    before = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
    for name in names[:2]:
        jax.config.update(name, 0)
    # (on: the GPU / TPU proxies, run in-process by other tests of this worker, turn the cache off)
    jax.config.update("jax_enable_compilation_cache", True)
    # JAX decides once per process whether its cache is in use (at the first compile, then remembered until
    # reset_cache()): an earlier compile of this worker's, with no cache folder, would leave it off here
    reset_cache()
    # and a program an earlier test of this worker compiled would come from JAX's in-memory caches: never
    # compiled here, never written to this folder
    jax.clear_caches()
    yield
    for name, value in before.items():
        jax.config.update(name, value)


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


def test_a_second_engine_loads_from_the_persistent_cache(bundled, monkeypatch):
    cfg, params, tok = bundled
    monkeypatch.setattr(executables, "store_folder", lambda: None)  # (JAX's cache alone: it traces again)
    first = Engine(params, cfg, tok).precompile(DUAL, [(2, 48)])
    jax.clear_caches()  # (else JAX's in-memory caches answer: the engines' own programs are unaffected)
    logged = []
    second = Engine(params, cfg, tok, log=logged.append).precompile(DUAL, [(2, 48)])
    assert len(first) == len(second) == 1
    rec = second[0]
    assert rec.cache_hit, "the persistent cache holds the program the first engine compiled"
    assert logged[0].startswith("compiling the fastdllm block program for batch 2, prompt slot 48")
    assert logged[1].startswith("loaded the fastdllm block program") and "tracing and lowering" in logged[1]
    assert "1 of 1 program from the compilation cache" in compile_summary(second)
    assert compile_summary([]) == ""


@pytest.fixture
def store(monkeypatch, tmp_path):
    """An empty executable store of this test's own."""
    folder = str(tmp_path / "executables")
    monkeypatch.setattr(executables, "store_folder", lambda: folder)
    return folder


def _traced(monkeypatch) -> list:
    """Counts the traces of the block program from now on."""
    from polestar_jax.engine import engine as engine_mod

    calls, real = [], engine_mod.decode_block

    @functools.wraps(real)  # (its signature: jit finds the static "spec" by name)
    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(engine_mod, "decode_block", counted)
    return calls


def _own(gen_length: int) -> DecodeConfig:
    """DUAL at a generation length no other test compiles: XLA compiles it here (only what XLA compiled in
    this process is stored, not what JAX's caches answered)."""
    return dataclasses.replace(DUAL, gen_length=gen_length, steps=gen_length)


def test_a_second_engine_loads_from_the_executable_store_without_tracing(bundled, store, monkeypatch):
    """What an engine compiled, a later engine (a later process: the store is on disk) loads without tracing
    it, and decodes the same."""
    cfg, params, tok = bundled
    ids, dcfg = [tok.chat_prompt_ids(p) for p in PROMPTS[:2]], _own(40)
    first = Engine(params, cfg, tok)
    rec = first.precompile(dcfg, [(2, 48)])[0]
    assert not rec.from_store and rec.lower_seconds > 0 and len(os.listdir(store)) == 1
    # an entry or a folder others may write is not read (unpickling runs code): one warning, a compile
    entry = os.path.join(store, os.listdir(store)[0])
    for path, loose in ((store, 0o777), (entry, 0o666)):
        mode = os.stat(path).st_mode & 0o777
        os.chmod(path, loose)
        with pytest.warns(UserWarning, match="not using the executable store"):
            executables._UNTRUSTED_WARNED.clear()
            rec = Engine(params, cfg, tok).precompile(dcfg, [(2, 48)])[0]
        assert not rec.from_store and rec.lower_seconds > 0
        os.chmod(path, mode)
    traced, logged = _traced(monkeypatch), []
    second = Engine(params, cfg, tok, log=logged.append)
    rec = second.precompile(dcfg, [(2, 48)])[0]
    assert traced == [] and rec.from_store and rec.cache_hit and rec.lower_seconds == 0.0
    assert logged[1].startswith("loaded the fastdllm block program for batch 2, prompt slot 48") and \
        "from the executable store" in logged[1]
    assert "1 of 1 program from the compilation cache, 1 of them from the executable store" in compile_summary([rec])
    a, b = first.run(ids, dcfg, prompt_slot=48), second.run(ids, dcfg, prompt_slot=48)
    assert a.tokens.tolist() == b.tokens.tolist() and a.nfe.tolist() == b.nfe.tolist()


def test_the_store_misses_when_code_settings_or_shapes_change(bundled, store, monkeypatch):
    """A stored program is found only by the same code, JAX settings and shapes; a torn entry is dropped
    and compiled again."""
    cfg, params, tok = bundled
    dcfg = _own(56)
    Engine(params, cfg, tok).precompile(dcfg, [(2, 48)])
    key = ("block", "anything")
    with jax.default_matmul_precision("bfloat16"):
        other_precision = executables.digest(key)
    assert executables.digest(key) not in (None, other_precision)
    assert len(os.listdir(store)) == 1
    monkeypatch.setattr(executables, "_code_fingerprint", lambda: "another version of the code")
    traced = _traced(monkeypatch)
    rec = Engine(params, cfg, tok).precompile(dcfg, [(2, 48)])[0]
    assert not rec.from_store and traced  # traced again; one of JAX's caches answers the compile (not stored)
    rec = Engine(params, cfg, tok).precompile(dcfg, [(2, 64)])[0]
    assert not rec.from_store and len(os.listdir(store)) == 2  # another shape: compiled and stored
    for name in os.listdir(store):
        with open(os.path.join(store, name), "wb") as f:
            f.write(b"torn")
    jax.clear_caches()
    rec = Engine(params, cfg, tok).precompile(dcfg, [(2, 64)])[0]
    # the torn entry read was dropped; the program came from JAX's persistent cache (not stored again)
    assert not rec.from_store and rec.cache_hit and len(os.listdir(store)) == 1


def test_what_jax_caches_loaded_is_never_stored(bundled, tmp_path, monkeypatch):
    """An executable JAX's persistent cache loaded serializes without its kernels (its copy would fail when
    run): neither it nor JAX's in-memory answer holding it is stored."""
    cfg, params, tok = bundled
    dcfg, folder = _own(72), str(tmp_path / "executables")
    monkeypatch.setattr(executables, "store_folder", lambda: None)
    Engine(params, cfg, tok).precompile(dcfg, [(2, 48)])  # compiled: into the suite's persistent cache
    jax.clear_caches()
    assert Engine(params, cfg, tok).precompile(dcfg, [(2, 48)])[0].cache_hit  # loaded from it
    monkeypatch.setattr(executables, "store_folder", lambda: folder)
    rec = Engine(params, cfg, tok).precompile(dcfg, [(2, 48)])[0]  # JAX's in-memory cache answers
    assert not rec.from_store and not os.path.exists(folder)


def test_a_later_process_runs_what_the_store_holds(subprocess_env, tmp_path):
    """The store's purpose, end to end: a command compiles and stores its program; the same command in a new
    process loads it without tracing and prints the same answer (a stored program that lost its kernels
    would fail here, when run)."""
    import subprocess
    import sys

    env = dict(subprocess_env, POLESTAR_JAX_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "polestar_jax.generate", "--prompt", PROMPTS[0], "--decoder", "fastdllm",
           "--cache", "dual", "--gen-length", "32", "--block-length", "8"]
    runs = [subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[1].stderr[-2000:]
    assert "from the executable store" not in runs[0].stderr and len(os.listdir(tmp_path / "cache" / "executables")) == 1
    assert "from the executable store" in runs[1].stderr and "1 of them from the executable store" in runs[1].stdout
    assert runs[1].stdout.splitlines()[:2] == runs[0].stdout.splitlines()[:2]


def test_the_store_keeps_the_most_recently_used(tmp_path):
    for i in range(5):
        path = tmp_path / f"{i}.exe"
        path.write_bytes(b"x")
        os.utime(path, (1000 + i, 1000 + i))
    (tmp_path / ".tmp-old.exe").write_bytes(b"x")
    os.utime(tmp_path / ".tmp-old.exe", (1000, 1000))
    (tmp_path / ".tmp-now.exe").write_bytes(b"x")  # (being written by another process)
    executables._trim(str(tmp_path), keep=2)
    assert sorted(os.listdir(tmp_path)) == [".tmp-now.exe", "3.exe", "4.exe"]


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


def test_a_new_cache_folder_takes_effect_in_a_process_that_compiled_before(tmp_path):
    """JAX picks its cache folder at the first compile and keeps it: enable_compile_cache (the CLIs', load()'s)
    restarts the cache when it names another folder, so the programs after it are written there."""
    import jax.numpy as jnp

    from polestar_jax.engine.compile_cache import enable_compile_cache

    first = str(tmp_path / "xla")  # own_persistent_cache's folder
    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()
    assert os.listdir(first)
    other = enable_compile_cache(str(tmp_path / "other"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # (enable_compile_cache sets 0.5)
    before = set(os.listdir(first))
    jax.jit(lambda x: x * 3)(jnp.ones(3)).block_until_ready()
    assert set(os.listdir(first)) == before
    assert [f for f in os.listdir(other) if f.endswith("-cache")], "the program is written to the new folder"
