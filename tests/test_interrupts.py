"""Ctrl-C at any moment ends a command within 2 s with one ``interrupted`` line and exit status 130, and
leaves the compilation cache valid (issue #11, section 3)."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from polestar_jax import cli
from polestar_jax.engine import compile_cache
from polestar_jax.io import files

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "polestar_jax.generate", "--prompt", "reverse: ann,bob,cal"]


def _interrupt_after(delay: float, env: dict) -> tuple[int, str, str, float]:
    p = subprocess.Popen(COMMAND, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    time.sleep(delay)
    sent = time.monotonic()
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    # (the compile progress lines, "compiling ..." / "compiled ... in" / "loaded ... from", may come before the
    # interrupt)
    err = "".join(line for line in err.splitlines(keepends=True)
                  if not line.startswith(("compiling ", "compiled ", "loaded ")))
    return p.returncode, out, err, time.monotonic() - sent


def test_sigint_at_every_stage_leaves_a_valid_cache(subprocess_env, tmp_path):
    """Signals during the imports, the model load, the XLA compilation (cold cache) and, with a warm cache,
    the run itself; then the same command runs to the end on that cache without a cache warning. (One delay
    per stage of the cold run: the imports, the model load, the compilation.)"""
    env = dict(subprocess_env, POLESTAR_JAX_CACHE=str(tmp_path / "cc"))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    for delay in (0.3, 1.5, 5.0):
        code, out, err, took = _interrupt_after(delay, env)
        assert (code, err) == (130, "interrupted\n"), (delay, code, out, err[-2000:])
        assert took < 2.0, (delay, took)
        assert out == ""
    done = subprocess.run(COMMAND, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "cache" not in done.stderr.lower(), done.stderr
    assert any((tmp_path / "cc").iterdir())  # the run filled the cache
    code, out, err, took = _interrupt_after(2.5, env)  # warm cache: load, decode or print
    assert code in (0, 130) and took < 2.0, (code, err)
    if code == 130:
        assert err == "interrupted\n"
    again = subprocess.run(COMMAND, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines()[:2] == done.stdout.splitlines()[:2]  # same answer (timings differ)


def test_cache_writes_finish_before_an_interrupt_exits(monkeypatch, tmp_path):
    """A compilation-cache entry is written under the lock the interrupt handler takes before exiting."""
    from jax._src import lru_cache

    compile_cache.guard_compile_cache_writes()
    compile_cache.guard_compile_cache_writes()  # idempotent
    assert getattr(lru_cache.LRUCache.put, "_polestar_guarded", False)
    held = []
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    real = cache._evict_if_needed  # called by put() just before it writes the entry

    def spy(**kw):
        held.append(files.WRITE_LOCK._is_owned())
        return real(**kw)

    monkeypatch.setattr(cache, "_evict_if_needed", spy)
    cache.put("k", b"v" * 10)
    assert held and all(held)
    assert cache.get("k") == b"v" * 10


def test_atomic_write_replaces_whole_files(tmp_path):
    f = tmp_path / "out.json"
    files.atomic_write(str(f), "old")
    files.atomic_write(str(f), "new")
    assert f.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left
    with pytest.raises(TypeError):
        files.atomic_write(str(f), 3)  # type: ignore[arg-type]
    assert f.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_run_main_returns_exit_codes():
    from polestar_jax.errors import PolestarError

    def bad(argv):
        raise PolestarError("nope\n  really")

    assert cli.run_main(lambda argv: 0) == 0
    assert cli.run_main(bad) == 2
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("rc", cli.run_main(lambda argv: 3)))
    t.start()
    t.join()
    assert box["rc"] == 3  # off the main thread it runs inline
    with pytest.raises(ZeroDivisionError):  # a bug is not an input error: its traceback is kept
        cli.run_main(lambda argv: 1 // 0)
