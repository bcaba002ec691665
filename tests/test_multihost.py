"""Multi-process runs: two CPU processes on 127.0.0.1 (4 simulated devices each) join one JAX runtime (gloo
collectives) and decode over one mesh of all 8 devices; results must equal one process on one device.

One pair of processes per mesh layout (``data=2,model=4``; ``data=1,model=8``) runs every check of that layout
in one go (tests/multihost_driver.py: each program is compiled once per pair; the pair shares the session's
compilation cache); it is killed, group and all, if it overruns. The single-device references run in this
process, once per module."""
from __future__ import annotations

import contextlib
import io
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
DRIVER = os.path.join(ROOT, "tests", "multihost_driver.py")
MARK = "@@ "  # the driver's record line after each command (tests/multihost_driver.py)
PROMPTS = ["reverse: ann,bob,cal,dan", "copy: gus,hal,ivy"]
ISSUE_PROMPT = PROMPTS[0]
DEVICES = 4  # per process
LAYOUTS = ("data=2,model=4", "data=1,model=8")
PAIR_TIMEOUT_S = 600

_DECODERS = {"llada": ["--decoder", "llada"], "fastdllm": ["--decoder", "fastdllm", "--cache", "dual"]}
_ISSUE = ["--prompt", ISSUE_PROMPT, "--refresh-buckets", "1"]  # the issue's command, Polestar (one refresh
# width: cheaper to compile; tokens do not depend on it, tests/test_refresh.py)

# the local lm-eval task of tests/test_eval.py (9 held-out bench.tasks instances, batch 7, prompt slot 64) and
# the bench.run job of the same instances, both with Fast-dLLM's dual cache (cheaper to compile than Polestar,
# whose multi-process runs are checked through generate and crosscheck; the eval path is the same)
EVAL_TASK = "polestar_local"
EVAL_FLAGS = ["--tasks", EVAL_TASK, "--include-path", os.path.join(DATA, "eval_local"), "--apply-chat-template",
              "--batch-size", "7", "--model-args", "pad_multiple=64", "--bootstrap-iters", "0", "--no-progress",
              "--decoder", "fastdllm", "--cache", "dual"]
BENCH_DECODER = "fastdllm-dual"
BENCH_FLAGS = ["--n", "3", "--tasks", "copy,sort,add", "--decoders", BENCH_DECODER, "--no-sweep", "--repeats", "1",
               "--batch", "7", "--no-flops", "--no-projection", "--no-progress"]


def _has_lm_eval() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(env: dict, argvs: list[list[str]], devices: int, timeout: float) -> list[tuple]:
    """Starts len(argvs) processes (process i runs argvs[i]) joined at a fresh 127.0.0.1 port; waits at
    most ``timeout`` s, killing each process group on overrun or error. Returns [(rc, stdout, stderr)]."""
    port = _free_port()
    procs = []
    try:
        for i, argv in enumerate(argvs):
            e = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                     JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(len(argvs)),
                     JAX_PROCESS_ID=str(i), POLESTAR_JAX_JOIN_TIMEOUT="120")
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


def _records(stdout: str) -> list[tuple[dict, str]]:
    """(the driver's record, what the command printed on stdout) per command, in order."""
    out, lines = [], []
    for ln in stdout.splitlines():
        if ln.startswith(MARK):
            out.append((json.loads(ln[len(MARK):]), "\n".join(lines)))
            lines = []
        else:
            lines.append(ln)
    assert not lines, lines[-20:]  # nothing after the last command
    return out


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def _quietly(fn, *args):
    """(fn(*args), its stdout)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = fn(*args)
    return rc, buf.getvalue()


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


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """The same commands in this process, on its one default device: generate's JSON line for llada and
    Fast-dLLM dual (both prompts) and Polestar (the issue's command); with lm-eval, the eval of the local task
    (its JSON line, results.json and samples)."""
    import jax

    from polestar_jax import eval as ev
    from polestar_jax.generate import main as generate

    mp = pytest.MonkeyPatch()
    mp.setenv("POLESTAR_JAX_CACHE", "off")
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    refs = {}
    try:
        for name, argv in [(d, _argv(PROMPTS, *flags)) for d, flags in _DECODERS.items()] + [("polestar", _ISSUE)]:
            rc, out = _quietly(generate, argv + ["--json"])
            assert rc == 0, out
            refs[name] = _last_json(out)
        if _has_lm_eval():
            path = tmp_path_factory.mktemp("eval_reference") / "out"
            rc, out = _quietly(ev.main, EVAL_FLAGS + ["--output-path", str(path), "--json"])
            assert rc == 0, out
            refs["eval"] = {"json": _last_json(out), "samples": _samples(path)}
    finally:
        mp.undo()
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)  # enable_compile_cache sets 0.5
    return refs


def _argv(prompts, *flags) -> list[str]:
    return [a for p in prompts for a in ("--prompt", p)] + list(flags)


def _samples(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, f"samples_{EVAL_TASK}.jsonl")) as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


def _commands(mesh: str, subset: str, tmp) -> list[tuple[str, list]]:
    """(name, driver command) of every check of layout ``mesh``; the first command joins the runtime. Both
    layouts: llada and Fast-dLLM dual (generate), the parameter shards. Polestar: at data=2 (the batch split
    over the processes) the golden replay of 2 cases, one per process (tokens, NFE and block stats equal to
    the reference's, as one device's are); at data=1 the issue's command against one device. data=2 also:
    eval and bench.run, the text API, bad input."""
    split = mesh.startswith("data=2")
    cmds = []
    if split and _has_lm_eval():  # eval joins by itself; bench.run decodes the same job
        cmds += [("eval", ["eval", *EVAL_FLAGS, "--mesh", mesh, "--output-path", str(tmp / "eval{process}"),
                           "--json"]),
                 ("bench", ["bench", *BENCH_FLAGS, "--mesh", mesh, "--out", str(tmp / "bench{process}")])]
    cmds += [(dec, ["generate", *_argv(PROMPTS, *flags), "--mesh", mesh, "--json"])
             for dec, flags in _DECODERS.items()]
    if split:
        cmds += [("api", ["api", mesh, PROMPTS]),  # same shapes as the llada run: no compile
                 ("golden", ["crosscheck", "--mesh", mesh, "--batch", "2", subset])]
    else:
        cmds.append(("polestar", ["generate", *_ISSUE, "--mesh", mesh, "--json"]))
    cmds.append(("shards", ["shards", mesh, os.path.join(DATA, "polestar_tiny_p")]))  # (loads only)
    if split:
        cmds.append(("bad_input", ["generate", "--prompt", " ", "--mesh", mesh]))  # status 2 everywhere
    return cmds


@pytest.mark.parametrize("mesh", LAYOUTS)
def test_two_processes_decode_like_one_device(mesh, subprocess_env, polestar_subset, references, tmp_path):
    """2 processes x 4 CPU devices over one mesh: llada and Fast-dLLM dual (both prompts; at data=2 split over
    the processes) print what one process on one device prints (text, tokens, NFE), from process 0 only;
    Polestar is exact (data=1,model=8: the issue's command prints one device's text, tokens, NFE and stats;
    data=2,model=4: the golden run file replays exactly, one case per process); each process holds only its
    parameter shards; every process exits with the same status. data=2,model=4 also: the eval CLI on the
    local task (results equal the one-device eval; process 0 alone writes files), bench.run on the same job
    (the same accounting), the text API, bad input (status 2 everywhere)."""
    cmds = _commands(mesh, polestar_subset, tmp_path)
    names = [n for n, _ in cmds]
    argv = [sys.executable, DRIVER, json.dumps([c for _, c in cmds])]
    env = dict(subprocess_env, POLESTAR_JAX_CACHE=os.environ["POLESTAR_JAX_CACHE"], HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", JAX_DEFAULT_MATMUL_PRECISION="highest")
    t0 = time.monotonic()
    (rc0, out0, err0), (rc1, out1, err1) = _launch(env, [argv, argv], devices=DEVICES, timeout=PAIR_TIMEOUT_S)
    print(f"{mesh}: two-process pair {time.monotonic() - t0:.0f} s")
    want_rcs = [2 if n == "bad_input" else 0 for n in names]
    assert rc0 == rc1 == max(want_rcs), (rc0, rc1, err0[-3000:], err1[-3000:])
    recs0, recs1 = _records(out0), _records(out1)
    cost = {n: (a["seconds"], a["cpu_seconds"], b["cpu_seconds"]) for n, (a, _), (b, _) in zip(names, recs0, recs1)}
    print(f"{mesh}: per command (wall s, CPU s of process 0, of process 1): {cost}")
    assert [r["rc"] for r, _ in recs0] == [r["rc"] for r, _ in recs1] == want_rcs
    assert all(text == "" for _, text in recs1), recs1  # process 1 prints no results ...
    assert "[Gloo]" not in out0  # ... and native chatter goes to stderr
    got = {n: (r, text) for n, (r, text) in zip(names, recs0)}
    got1 = {n: r for n, (r, _) in zip(names, recs1)}

    for dec in _DECODERS:
        res = _last_json(got[dec][1])
        for key in ("text", "token_ids", "nfe"):
            assert res[key] == references[dec][key], (mesh, dec, key)
    assert ("polestar" in got) != ("golden" in got)
    if "polestar" in got:
        res = _last_json(got["polestar"][1])
        for key in ("text", "token_ids", "nfe", "refresh_steps", "early_commits", "suffix_commits",
                    "windowed_passes"):
            assert res[key] == references["polestar"][key], (mesh, key)
        assert res["text"] == "dan,cal,bob,ann"
    if "golden" in got:
        assert got["golden"][1].splitlines()[-1] == "2 passed, 0 failed", got["golden"][1]
    if "api" in got:
        want = [[t, n] for t, n in zip(references["llada"]["text"], references["llada"]["nfe"])]
        assert got["api"][0]["value"] == got1["api"]["value"] == want
    if "bad_input" in got:
        assert got["bad_input"][1] == ""
    if "shards" in got:  # the MLP splits over model; attention only in whole heads (4 heads: not on 8)
        m = int(mesh.split("model=")[1])
        with open(os.path.join(DATA, "polestar_tiny_p", "config.json")) as f:
            heads = json.load(f)["n_heads"]
        for sh in (got["shards"][0]["value"], got1["shards"]["value"]):
            n, d, q = sh["wq"]["global"]
            want = [n, d, q // m] if heads % m == 0 else [n, d, q]
            assert sh["wq"]["local"] == [want] * DEVICES and sh["wq"]["equal"]
            n, f, d = sh["w_down"]["global"]
            assert sh["w_down"]["local"] == [[n, f // m, d]] * DEVICES and sh["w_down"]["equal"]
    if "eval" in got:
        _check_eval_and_bench(got["eval"][1], got["bench"][1], tmp_path, references["eval"])


def _check_eval_and_bench(eval_out: str, bench_out: str, tmp, ref: dict) -> None:
    """The two-process eval equals the one-device eval (metric, accounting, every response and its
    forwards), bench.run's rows agree with it; only process 0 wrote files."""
    assert not (tmp / "eval1").exists() and not (tmp / "bench1").exists()
    last = _last_json(eval_out)
    assert last["results"] == ref["json"]["results"]
    for key in ("requests", "nfe", "non_eos_tokens", "tpf"):
        assert last["polestar_jax"]["total"][key] == ref["json"]["polestar_jax"]["total"][key], key
    samples = _samples(tmp / "eval0")
    assert [s["resps"] for s in samples] == [s["resps"] for s in ref["samples"]]
    assert [[r["nfe"] for r in s["polestar_jax"]] for s in samples] == \
        [[r["nfe"] for r in s["polestar_jax"]] for s in ref["samples"]]
    results = json.load(open(tmp / "eval0" / "results.json"))
    assert results["polestar_jax"]["device"]["process_count"] == 2
    assert results["polestar_jax"]["device"]["count"] == 2 * DEVICES

    assert f"| {BENCH_DECODER} |" in bench_out  # process 0's markdown table
    rows = {r["task"]: r for r in json.load(open(tmp / "bench0" / "results.json")) if r["decoder"] == BENCH_DECODER}
    pj = last["polestar_jax"]["total"]
    assert rows["all"]["accuracy"] == pytest.approx(last["results"][EVAL_TASK]["exact_match,none"], abs=1e-12)
    assert rows["all"]["non_eos_tokens"] == pj["non_eos_tokens"]
    assert rows["all"]["nfe"] == pytest.approx(pj["nfe_per_request"], abs=1e-12)
    assert rows["all"]["tpf"] == pytest.approx(pj["tpf"], abs=1e-12)
    run = json.load(open(tmp / "bench0" / "run.json"))
    assert run["config"]["mesh"] == "data=2,model=4"


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


def test_eval_and_bench_take_the_join_flags(capsys, monkeypatch, tmp_path):
    """The eval CLI and bench.run parse the same join flags and report bad ones in one line (status 2)."""
    from bench import run as bench_run
    from polestar_jax import eval as ev

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    bad = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "5"]
    mains = [(bench_run.main, ["--out", ""])]
    if _has_lm_eval():
        mains.append((ev.main, EVAL_FLAGS + ["--output-path", str(tmp_path / "out")]))
    for main, argv in mains:
        capsys.readouterr()
        assert main(argv + bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0] == "error: process id 5 is not in [0, 2)", err
    assert not (tmp_path / "out").exists()


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
    from polestar_jax.io.checkpoint import load_model, save_converted

    mesh = sharding.make_mesh(f"data=1,model={len(jax.devices())}")
    folder = os.path.join(DATA, "polestar_tiny_p")
    cfg, full = load_model(folder, dtype="float32")
    save_converted(tmp_path / "conv", cfg, full)
    for path, dtype in ((folder, None), (folder, "bfloat16"), (str(tmp_path / "conv"), "bfloat16")):
        _, a = load_model(path, dtype=dtype)
        _, b = load_model(path, dtype=dtype, shardings=mesh)
        want = sharding.param_shardings(a, mesh, cfg)  # (whole heads, as load_model splits them)
        for x, y, s in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(want)):
            assert x.dtype == y.dtype and y.sharding == s
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
