"""Shared fixtures: the tiny golden model (loaded once per session), its cases, float32 matmul precision.

Speed: the suite compiles each decode shape once per process. Subprocess tests (the CLIs) and the
pytest-xdist workers (``-n 2``, one test file per worker: ``--dist loadfile``) would compile the same
executables again, so the session uses a private, throw-away persistent compilation cache that they all
share (see ``subprocess_env``); results are unaffected, only compile time is saved.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

# The suite runs on the CPU (simulated devices where a test needs several), and so do the commands it starts:
# with libtpu (the test extra's, for tests/test_tpu_compile.py) or a CUDA plugin installed and no such device,
# JAX would probe for it at every start and print errors. Set before JAX is imported; subprocesses inherit it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest

# Golden comparisons are made in float32 with exact matmuls (set before anything compiles).
jax.config.update("jax_default_matmul_precision", "highest")

# (The cache key includes the cache folder path, so subprocesses must get this same path.) The settings also
# go into the environment, so the pytest-xdist workers, started after this runs in the controlling process,
# share the cache: a program one worker compiled is read by the other.
# Only programs that took CACHE_MIN_COMPILE_SECS or more to compile are written (the ones worth sharing): far
# fewer executables serialized. Twice a CI worker died of a native crash in a test that compiles, once inside
# XLA's executable serializer writing a cache entry (the other's stack was not kept); a hedge, not a cure.
CACHE_MIN_COMPILE_SECS = 1.0
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _CACHE_DIR = tempfile.mkdtemp(prefix="polestar_jax_test_cc_")
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_CACHE_DIR,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=str(CACHE_MIN_COMPILE_SECS),
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
TINY_A_DIR = DATA / "llada_tiny_a"
DREAM_DIR = DATA / "dream_tiny_a"


@pytest.fixture(scope="session", autouse=True)
def matmul_precision_highest():
    """Every test runs with ``jax_default_matmul_precision = "highest"`` (the golden tolerance assumes it)."""
    jax.config.update("jax_default_matmul_precision", "highest")
    yield "highest"


@pytest.fixture(scope="session")
def tiny_a():
    """(cfg, params) of ``tests/data/llada_tiny_a`` in float32."""
    from polestar_jax.io.checkpoint import load_model

    return load_model(str(TINY_A_DIR), dtype="float32")


@pytest.fixture(scope="session")
def dream():
    """(cfg, params) of ``tests/data/dream_tiny_a`` in float32."""
    from polestar_jax.io.checkpoint import load_model

    return load_model(str(DREAM_DIR), dtype="float32")


@pytest.fixture(scope="session")
def dream_cases() -> dict:
    """The parsed ``tests/data/dream_tiny_a/cases.json``."""
    with open(DREAM_DIR / "cases.json") as f:
        return json.load(f)


@pytest.fixture(scope="session")
def tiny_a_cases() -> dict:
    """The parsed ``tests/data/llada_tiny_a/cases.json``."""
    with open(TINY_A_DIR / "cases.json") as f:
        return json.load(f)


GOLDEN_SLOT = 48  # one prompt slot for every golden generation (prompts of 12 / 25 / 41 tokens)
_FUNCTIONS = {  # reference function -> (decoder, cache)
    "llada.generate": ("llada", "none"),
    "fastdllm.generate": ("fastdllm", "none"),
    "fastdllm.generate_with_prefix_cache": ("fastdllm", "prefix"),
    "fastdllm.generate_with_dual_cache": ("fastdllm", "dual"),
}


def golden_decode_config(case: dict):
    """The :class:`DecodeConfig` of one ``generate_cases`` entry (written here, independent of crosscheck)."""
    from polestar_jax.config import DecodeConfig

    s = case["settings"]
    assert s.get("temperature", 0.0) == 0.0 and s.get("remasking", "low_confidence") == "low_confidence"
    decoder, cache = _FUNCTIONS[case["function"]]
    return DecodeConfig(decoder=decoder, cache=cache, gen_length=s["gen_length"], block_length=s["block_length"],
                        steps=s["steps"], threshold=s.get("threshold"), early_exit=False)


@pytest.fixture(scope="session")
def tiny_a_generations(tiny_a, tiny_a_cases) -> dict:
    """Case name -> :class:`GenerateResult` of every golden generate case, all at prompt slot 48 (21 executables),
    run once per session."""
    from engines import generate  # tests/engines.py

    cfg, params = tiny_a
    return {c["name"]: generate(params, cfg, [c["prompt_ids"]], golden_decode_config(c), prompt_slot=GOLDEN_SLOT)
            for c in tiny_a_cases["generate_cases"]}


@pytest.fixture(scope="session")
def subprocess_env() -> dict:
    """Environment for ``python -m polestar_jax...`` subprocesses: CPU, and this session's compile cache."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    cache_dir = jax.config.jax_compilation_cache_dir
    if cache_dir:
        env.update(JAX_COMPILATION_CACHE_DIR=cache_dir,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=str(CACHE_MIN_COMPILE_SECS),
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


@pytest.fixture
def offline_session_cache(monkeypatch):
    """For tests of load() and the CLIs, which turn on the persistent cache: this session's (never the
    user's), and no hub look-ups."""
    monkeypatch.setenv("POLESTAR_JAX_CACHE", jax.config.jax_compilation_cache_dir or "off")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)  # enable_compile_cache sets 0.5


#: The test files that take longest (mesh and multi-process subprocesses, the golden Polestar replays), in
#: this order before all others, so that on pytest-xdist workers (``--dist loadfile``, files handed out in
#: collection order: ``--no-loadscope-reorder`` in pyproject.toml) they start first and short files fill the end.
LONG_FILES = ("test_dream_scale.py", "test_scale.py", "test_multihost.py", "test_polestar.py", "test_scheduler.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order
