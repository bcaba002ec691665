"""Shared fixtures: the tiny golden model (loaded once per session), its cases, float32 matmul precision.

Speed: the suite compiles each decode shape once per process (shared module / session fixtures).

No persistent compilation cache: the suite's processes (the pytest-xdist workers, the CLIs they start)
serialize no executable, except the tests of the cache and the executable store themselves, with folders
of their own, and never touch the user's cache. ``POLESTAR_JAX_CACHE=off`` for the whole session keeps
``load()`` and the command lines from turning it on (two module fixtures' ``load()`` did, for every later
test of their worker), and :func:`no_persistent_cache_left_on` fails a test that starts with the cache on.

Compiled code: XLA:CPU maps each kernel it compiles apart, and a worker that holds too many programs passes
the kernel's ``vm.max_map_count`` and crashes at its next compile (:data:`RELEASE_AT`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

# The suite runs on the CPU (simulated devices where a test needs several), and so do the commands it starts:
# with libtpu (the test extra's, for tests/test_tpu_compile.py) or a CUDA plugin installed and no such device,
# JAX would probe for it at every start and print errors. Set before JAX is imported; subprocesses inherit it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# and without a persistent compilation cache, whatever the environment says (see above; subprocess_env too)
_NO_CACHE = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")
for _name in [k for k in os.environ if k.startswith(_NO_CACHE)]:
    del os.environ[_name]
# the command lines and load() run in-process turn theirs on (in the user's ~/.cache) unless told: off, and a
# test of the cache sets a folder of its own (monkeypatch.setenv)
os.environ["POLESTAR_JAX_CACHE"] = "off"

import jax  # noqa: E402
import pytest

# Golden comparisons are made in float32 with exact matmuls (set before anything compiles).
jax.config.update("jax_default_matmul_precision", "highest")

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
TINY_A_DIR = DATA / "llada_tiny_a"
DREAM_DIR = DATA / "dream_tiny_a"


@pytest.fixture(scope="session", autouse=True)
def matmul_precision_highest():
    """Every test runs with ``jax_default_matmul_precision = "highest"`` (the golden tolerance assumes it)."""
    jax.config.update("jax_default_matmul_precision", "highest")
    yield "highest"


@pytest.fixture(autouse=True)
def no_persistent_cache_left_on():
    """No test starts with JAX's persistent compilation cache on (a module or session fixture that turns it
    on, such as ``load()`` without ``compile_cache=False``, fails here), and a test that turns it on (the
    cache's own tests, a command line run in-process with a cache folder) has it turned off after it."""
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    assert jax.config.jax_compilation_cache_dir is None, (
        f"the persistent compilation cache is on ({jax.config.jax_compilation_cache_dir}) before the test: a "
        "fixture turned it on (load(compile_cache=False) in fixtures; the suite runs without one)")
    yield
    if jax.config.jax_compilation_cache_dir is not None:
        jax.config.update("jax_compilation_cache_dir", None)
        reset_cache()


def mappings() -> int:
    """Memory mappings of this process (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


#: A worker process releases its compiled programs past this many memory mappings. XLA:CPU maps each
#: kernel of a program it compiles apart (a Polestar block program of the bundled model: ~1,400 mappings),
#: and a process past the kernel's limit (vm.max_map_count, 65,530 by default) cannot map more: LLVM fails
#: with "Cannot allocate memory" and XLA crashes (the suite's native crashes in CI and here, in whichever
#: test compiled then). The shared engines keep up to 32 programs each.
RELEASE_AT = _map_limit() // 3


@pytest.fixture(scope="module", autouse=True)
def compiled_programs_released_before_the_mapping_limit():
    """After each test file, a worker with many mappings drops its compiled programs: the shared engines
    (tests/engines.py), every other live engine's programs and JAX's caches. (A full suite on 2 workers
    peaked at ~36,000 mappings after one file, tests/test_scheduler.py, which had started at ~21,000.)"""
    yield
    if mappings() > RELEASE_AT:
        import gc

        from engines import release_all
        from polestar_jax.engine.engine import Engine

        release_all()
        Engine.clear_all()
        jax.clear_caches()
        gc.collect()


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
    """Environment for ``python -m polestar_jax...`` subprocesses: CPU, and no persistent compile cache (the
    command lines turn theirs on unless ``POLESTAR_JAX_CACHE=off``, which the tests set)."""
    return dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), POLESTAR_JAX_CACHE="off")


@pytest.fixture
def offline_session_cache(monkeypatch):
    """For tests of load() and the CLIs, which turn on the persistent cache unless told: off (never the
    user's; the suite serializes no executable), and no hub look-ups."""
    monkeypatch.setenv("POLESTAR_JAX_CACHE", "off")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)  # enable_compile_cache sets 0.5


#: The test files that take longest (mesh and multi-process subprocesses, the golden Polestar replays), in
#: this order before all others, so that on pytest-xdist workers (``--dist loadfile``, files handed out in
#: collection order: ``--no-loadscope-reorder`` in pyproject.toml) they start first and short files fill the end.
LONG_FILES = ("test_dream_scale.py", "test_scale.py", "test_multihost.py", "test_polestar.py", "test_scheduler.py")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """A native crash (a segfault in XLA) prints the stack of the thread that crashed, not of every thread:
    pytest's faulthandler dumps all of them, and a CI log's tail then holds only the idle main thread."""
    import faulthandler

    from _pytest.faulthandler import fault_handler_stderr_fd_key

    fd = config.stash.get(fault_handler_stderr_fd_key, None)
    if fd is not None and faulthandler.is_enabled():
        faulthandler.enable(file=fd, all_threads=False)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order
