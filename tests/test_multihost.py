"""Multi-process runs: two CPU processes on 127.0.0.1 (2 simulated devices each) join one JAX runtime
(gloo collectives) and decode over one mesh spanning both; results must equal one process on one device.

One pair of processes runs every multi-process check in one script (each compile is paid once per pair;
the pair shares the session's compilation cache), and is killed if it overruns."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
PROMPTS = ["reverse: ann,bob,cal,dan", "copy: gus,hal,ivy"]
ISSUE_PROMPT = PROMPTS[0]
PAIR_TIMEOUT_S = 900

# Runs the commands of argv[1] (a JSON list) in this process, joined by the first of them; each command's
# exit status goes to stderr (stdout carries only what the commands print: process 0's results).
_WORKER = r"""
import json, sys, time
import numpy as np
from polestar_jax import crosscheck, generate, sharding

def shards(spec, folder):  # each process holds (and read) only its shards, equal to the full tensor's slices
    from polestar_jax.checkpoint import load_model
    mesh = sharding.make_mesh(spec)
    _, full = load_model(folder, dtype="float32")
    _, sh = load_model(folder, dtype="float32", shardings=mesh)
    out = {}
    for key in ("wq", "w_down"):
        a, ref = sh["blocks"][key], np.asarray(full["blocks"][key])
        out[key] = {"global": list(a.shape), "local": [list(s.data.shape) for s in a.addressable_shards],
                    "equal": all(np.array_equal(np.asarray(s.data), ref[s.index]) for s in a.addressable_shards)}
    return out

def api(spec, prompts):
    from polestar_jax.api import load
    out = load(mesh=spec).generate(prompts, decoder="llada")
    return [[r.text, r.nfe] for r in out]

rcs, seconds = [], []
for cmd in json.loads(sys.argv[1]):
    kind, args = cmd[0], cmd[1:]
    t0 = time.monotonic()
    if kind == "generate":
        rcs.append(generate.main(args))
    elif kind == "crosscheck":
        rcs.append(crosscheck.main(args))
    else:
        print(kind.upper() + " " + json.dumps({"shards": shards, "api": api}[kind](*args)), file=sys.stderr)
        rcs.append(0)
    seconds.append(round(time.monotonic() - t0, 1))
    print("RCS " + json.dumps(rcs), file=sys.stderr, flush=True)
    print("SECONDS " + json.dumps(seconds), file=sys.stderr, flush=True)
sys.exit(max(rcs))
"""


@pytest.fixture(autouse=True)
def _session_cache(monkeypatch):
    """Commands run here (and their subprocesses) use the session's compilation cache."""
    import jax

    monkeypatch.setenv("POLESTAR_JAX_CACHE", jax.config.jax_compilation_cache_dir or "off")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(env: dict, argvs: list[list[str]], devices: int, timeout: float, extra_env=None) -> list[tuple]:
    """Starts len(argvs) processes (process i runs argvs[i]) joined at a fresh 127.0.0.1 port; waits at
    most ``timeout`` s, killing the whole group on overrun. Returns [(rc, stdout, stderr)]."""
    port = _free_port()
    procs = []
    try:
        for i, argv in enumerate(argvs):
            e = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                     JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(len(argvs)),
                     JAX_PROCESS_ID=str(i), POLESTAR_JAX_JOIN_TIMEOUT="120", **(extra_env or {}))
            procs.append(subprocess.Popen(argv, env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        out = []
        for p in procs:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, so, se))
        return out
    finally:
        for p in procs:  # ours only, by process group id (each was started in a session of its own)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _json_lines(text: str) -> list[dict]:
    return [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]


def _tagged(stderr: str, tag: str):
    return json.loads([ln for ln in stderr.splitlines() if ln.startswith(tag + " ")][-1][len(tag) + 1:])


def _reference(capsys, argv: list[str]) -> dict:
    """The JSON line of ``generate`` run in this process, on its one default device."""
    from polestar_jax.generate import main

    capsys.readouterr()
    assert main(argv + ["--json"]) == 0
    return _json_lines(capsys.readouterr().out)[-1]


@pytest.fixture(scope="module")
def polestar_subset(tmp_path_factory) -> str:
    """tests/data/polestar_tiny_p with one Polestar run file (g64 b16: 2 cases), its trace and decisions."""
    src = os.path.join(DATA, "polestar_tiny_p")
    dst = tmp_path_factory.mktemp("polestar_subset")
    stem = "tiny_a_polestar_g64_b16_s64"
    for name in ("config.json", "model.safetensors", stem + ".json"):
        os.symlink(os.path.join(src, name), dst / name)
    for sub, names in (("traces", [stem + ".trace.json"]), ("decisions", [f"{stem}_case{i}.json" for i in (0, 1)])):
        (dst / sub).mkdir()
        for name in names:
            os.symlink(os.path.join(src, sub, name), dst / sub / name)
    return str(dst)


def _argv(prompts, *flags) -> list[str]:
    return [a for p in prompts for a in ("--prompt", p)] + list(flags)


_DECODERS = {"llada": ["--decoder", "llada"], "fastdllm": ["--decoder", "fastdllm", "--cache", "dual"]}
_ISSUE = _argv([ISSUE_PROMPT], "--refresh-buckets", "1")  # the issue's command (one refresh width: cheaper
# to compile; tokens do not depend on it, tests/test_refresh.py)


def test_two_processes_decode_like_one_device(subprocess_env, capsys, polestar_subset):
    """2 processes x 2 CPU devices: llada, Fast-dLLM dual (data=2,model=2: the batch split over the
    processes; data=1,model=4) and Polestar (the issue's command, data=1,model=4) print what one process on
    one device prints (tokens, NFE, Polestar stats), from process 0 only; the golden Polestar run file
    replays exactly (data=2,model=2, its 2 cases split over the processes); each process holds only its
    parameter shards; the text API joins and decodes; every process exits with the same status."""
    cmds = []
    for mesh in ("data=2,model=2", "data=1,model=4"):
        for dec, flags in _DECODERS.items():
            cmds.append(["generate"] + _argv(PROMPTS, *flags, "--mesh", mesh, "--json"))
        if mesh == "data=2,model=2":
            cmds.append(["api", mesh, PROMPTS])  # same shapes as the llada run: no compile
    cmds.append(["generate"] + _ISSUE + ["--mesh", "data=1,model=4", "--json"])
    cmds.append(["crosscheck", "--mesh", "data=2,model=2", "--batch", "2", polestar_subset])
    cmds.append(["shards", "data=1,model=4", os.path.join(DATA, "polestar_tiny_p")])
    cmds.append(["generate", "--prompt", " ", "--mesh", "data=2,model=2"])  # bad input: status 2 everywhere
    argv = [sys.executable, "-c", _WORKER, json.dumps(cmds)]
    t0 = time.monotonic()
    env = dict(subprocess_env, POLESTAR_JAX_CACHE=os.environ["POLESTAR_JAX_CACHE"])
    (rc0, out0, err0), (rc1, out1, err1) = _launch(env, [argv, argv], devices=2, timeout=PAIR_TIMEOUT_S)
    seconds = time.monotonic() - t0
    assert rc0 == rc1 == 2, (rc0, rc1, err0[-3000:], err1[-3000:])
    assert _tagged(err0, "RCS") == _tagged(err1, "RCS") == [0] * (len(cmds) - 1) + [2]
    assert out1 == "", out1[-2000:]  # process 1 prints no results ...
    assert "[Gloo]" not in out0  # ... and native chatter goes to stderr
    results = _json_lines(out0)
    assert len(results) == 5, out0[-2000:]
    assert out0.rstrip().splitlines()[-1] == "2 passed, 0 failed", out0[-2000:]  # the golden replay

    # the single-process, single-device runs of the same commands
    refs = {dec: _reference(capsys, _argv(PROMPTS, *flags)) for dec, flags in _DECODERS.items()}
    issue_ref = _reference(capsys, _ISSUE)
    got = {("data=2,model=2", "llada"): results[0], ("data=2,model=2", "fastdllm"): results[1],
           ("data=1,model=4", "llada"): results[2], ("data=1,model=4", "fastdllm"): results[3]}
    for (mesh, dec), r in got.items():
        for key in ("token_ids", "nfe", "text"):
            assert r[key] == refs[dec][key], (mesh, dec, key)
    issue = results[4]
    for key in ("text", "token_ids", "nfe", "refresh_steps", "early_commits", "suffix_commits", "windowed_passes"):
        assert issue[key] == issue_ref[key], key
    assert issue["text"] == "dan,cal,bob,ann"
    assert _tagged(err0, "API") == _tagged(err1, "API") == [[t, n] for t, n in zip(refs["llada"]["text"],
                                                                                    refs["llada"]["nfe"])]
    for err in (err0, err1):
        sh = _tagged(err, "SHARDS")
        n, d, q = sh["wq"]["global"]
        assert sh["wq"]["local"] == [[n, d, q // 4]] * 2 and sh["wq"]["equal"]
        n, f, d = sh["w_down"]["global"]
        assert sh["w_down"]["local"] == [[n, f // 4, d]] * 2 and sh["w_down"]["equal"]
    print(f"two-process pair: {seconds:.0f} s; per command {_tagged(err0, 'SECONDS')}")


def test_unreachable_coordinator_fails_with_one_line(subprocess_env):
    """Process 1 of 2 with nobody listening at the coordinator address: one error line, status 2, within
    the join timeout (JAX alone would abort with a stack trace after 5 minutes)."""
    port = _free_port()
    env = dict(subprocess_env, POLESTAR_JAX_CACHE="off")  # (nothing is compiled)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "polestar_jax.generate", "--prompt", "x", "--coordinator",
                           f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1", "--join-timeout", "3"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach the coordinator 127.0.0.1:"), proc.stderr
    assert elapsed < 60


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "invalid coordinator address"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], "process id 2 is not in [0, 2)"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2"], "needs --process-id"),
])
def test_bad_join_flags_are_one_line_errors(flags, message, capsys, monkeypatch):
    from polestar_jax.generate import main

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert main(["--prompt", "x"] + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_join_runtime_without_settings_or_after_jax_started(monkeypatch):
    """Nothing configured: no join (a single process). Configured but JAX already uses its devices here:
    a one-line error instead of JAX's RuntimeError."""
    import jax

    from polestar_jax import sharding
    from polestar_jax.errors import PolestarError

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert sharding.join_runtime() is False
    assert sharding.join_runtime(num_processes=1) is False
    jax.devices()
    with pytest.raises(PolestarError, match="already uses its devices"):
        sharding.join_runtime("127.0.0.1:1", 2, 0, timeout=1)


def test_sharded_load_equals_load_then_device_put(tmp_path):
    """load_model(..., shardings=mesh) builds each array from its checkpoint slices; the result is bit for bit
    the plain load placed with the same shardings (HF folder: f32 stored, cast to bf16; a converted orbax
    folder restored with shardings)."""
    import jax
    import numpy as np

    from polestar_jax import sharding
    from polestar_jax.checkpoint import load_model, save_converted

    mesh = sharding.make_mesh(f"data=1,model={len(jax.devices())}")
    folder = os.path.join(DATA, "polestar_tiny_p")
    cfg, full = load_model(folder, dtype="float32")
    save_converted(tmp_path / "conv", cfg, full)
    for path, dtype in ((folder, None), (folder, "bfloat16"), (str(tmp_path / "conv"), "bfloat16")):
        _, a = load_model(path, dtype=dtype)
        _, b = load_model(path, dtype=dtype, shardings=mesh)
        want = sharding.param_shardings(a, mesh)
        for x, y, s in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(want)):
            assert x.dtype == y.dtype and y.sharding == s
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
