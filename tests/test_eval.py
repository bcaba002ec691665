"""``python -m polestar_jax.eval`` and the ``polestar-jax`` lm-eval model, offline, on the local task
``tests/data/eval_local`` (held-out bench.tasks instances, exact-match scorer) with the bundled tiny_tasks model.

Shapes are shared with tests/test_bench_run.py (the same 9 instances -- copy, sort, add x 3 -- at prompt slot 64,
batch 7 or 1; Polestar and the checked dual cache), so a full run compiles each executable once; run alone this
file compiles Polestar's block step once (~12 s on an idle 2-core CPU), and the subprocess loads it from the
session's compilation cache.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from bench import tasks as T  # noqa: E402
from polestar_jax import eval as ev  # noqa: E402
from polestar_jax import generate as gen_cli  # noqa: E402
from polestar_jax.config import PolestarConfig  # noqa: E402
from polestar_jax.errors import PolestarError  # noqa: E402
from polestar_jax.lm_eval_model import PolestarLM, apply_until, gen_length_for, parse_model_args  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCAL = REPO_ROOT / "tests" / "data" / "eval_local"
TASK = "polestar_local"
TASKS, N, BATCH, SLOT = ("copy", "sort", "add"), 3, 7, 64  # as tests/test_bench_run.py's smoke job
#: the eval flags every run here shares: chat template (bench.run's prompts), one prompt slot, batch 7
COMMON = ["--tasks", TASK, "--include-path", str(LOCAL), "--apply-chat-template", "--batch-size", str(BATCH),
          "--model-args", f"pad_multiple={SLOT}", "--bootstrap-iters", "0", "--no-progress"]


def _items():
    return [(t, p, a) for t in TASKS for p, a in T.eval_instances(t, N)]


pytestmark = pytest.mark.usefixtures("offline_session_cache")


def _main(argv, capsys):
    code = ev.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(code, out, err, *needles):
    assert code == 2, (code, out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err + out
    for n in needles:
        assert n in lines[0], lines[0]


def _samples(out_dir: Path) -> list[dict]:
    with open(out_dir / f"samples_{TASK}.jsonl") as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def polestar_eval(tmp_path_factory):
    """The local task through the eval CLI (in-process ``main``, the same code path as ``python -m``) with
    the default decoder (Polestar) and lengths: (out dir, results.json, samples, the --json line)."""
    out = tmp_path_factory.mktemp("eval") / "polestar"
    mp = pytest.MonkeyPatch()
    mp.setenv("POLESTAR_JAX_CACHE", "off")
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    try:
        with redirect_stdout(buf):
            code = ev.main(COMMON + ["--output-path", str(out), "--json"])
    finally:
        mp.undo()
    assert code == 0, buf.getvalue()
    last = json.loads(buf.getvalue().strip().splitlines()[-1])
    return out, json.load(open(out / "results.json")), _samples(out), last


def test_local_task_data_is_bench_instances():
    rows = [json.loads(line) for line in open(LOCAL / "polestar_local.jsonl")]
    assert [(r["task"], r["prompt"], r["answer"]) for r in rows] == _items()


def test_eval_agrees_with_bench_run(polestar_eval):
    """Same instances, same decoder (Polestar defaults): accuracy, TPF, NFE and tokens equal bench.run's."""
    from bench import run as BR

    out, results, samples, last = polestar_eval
    rc = BR.RunConfig(n=N, tasks=TASKS, decoders=("polestar",), sweep=(), repeats=1, batch=BATCH, flops=False,
                      projection=False)
    bench = BR.run(rc, out_dir=None, progress=False)
    rows = {r["task"]: r for r in bench["rows"] if r["decoder"] == "polestar"}
    acc = results["results"][TASK]["exact_match,none"]
    pj = results["polestar_jax"]["tasks"][TASK]
    assert acc == pytest.approx(rows["all"]["accuracy"], abs=1e-12)  # 3 tasks x 3: micro mean = macro mean
    assert pj["tpf"] == pytest.approx(rows["all"]["tpf"], abs=1e-12)
    assert pj["nfe_per_request"] == pytest.approx(rows["all"]["nfe"], abs=1e-12)
    assert pj["non_eos_tokens"] == rows["all"]["non_eos_tokens"]
    for task in TASKS:  # per task too (the samples carry each request's accounting)
        mine = [s for s in samples if s["doc"]["task"] == task]
        assert np.mean([s["exact_match"] for s in mine]) == pytest.approx(rows[task]["accuracy"], abs=1e-12)
        nfe = sum(s["polestar_jax"][0]["nfe"] for s in mine)
        tok = sum(s["polestar_jax"][0]["non_eos_tokens"] for s in mine)
        assert tok / nfe == pytest.approx(rows[task]["tpf"], abs=1e-12)
    # the JSON line and results.json agree; TPS is tokens / decode seconds
    assert last["polestar_jax"]["total"]["tpf"] == pj["tpf"]
    assert pj["tps"] == pytest.approx(pj["non_eos_tokens"] / pj["decode_seconds"])
    assert results["polestar_jax"]["decoder"]["decoder"] == "polestar"
    assert results["polestar_jax"]["jax_version"] == jax.__version__ and results["polestar_jax"]["device"]
    assert {"results", "configs", "versions", "n-shot", "config"} <= set(results)


def test_eval_agrees_with_generate_prompts_file(polestar_eval, tmp_path, capsys, monkeypatch):
    """Request i of the task decodes as prompt i of ``generate --prompts-file`` (key (seed, i)): same text,
    forwards and TPF (7 prompts: generate's one batch is the eval's first batch shape)."""
    _, _, samples, _ = polestar_eval
    prompts = [p for _, p, _ in _items()][:BATCH]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n")
    assert gen_cli.main(["--prompts-file", str(f), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    for i, row in enumerate(got):
        s = samples[i]
        assert s["doc"]["prompt"] == row["prompt"]
        assert s["resps"][0][0] == row["text"], i
        rec = s["polestar_jax"][0]
        assert rec["row"] == i and rec["nfe"] == row["nfe"]
        assert rec["non_eos_tokens"] == row["non_eos_tokens"] and rec["tpf"] == pytest.approx(row["tpf"])


def test_eval_cli_subprocess(polestar_eval, subprocess_env, tmp_path):
    """``python -m polestar_jax.eval`` as a user runs it (progress bar on): the same results as in-process;
    the results file is never overwritten; code tasks need --allow-code-execution."""
    _, results, samples, _ = polestar_eval
    env = dict(subprocess_env, POLESTAR_JAX_CACHE="off",
               JAX_DEFAULT_MATMUL_PRECISION="highest", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    out = tmp_path / "sub"
    group = TASK + "_group"  # a group of the local task: its subtasks' accounting is reported under its name
    cmd = [sys.executable, "-m", "polestar_jax.eval", *COMMON, "--output-path", str(out)]
    cmd[cmd.index(TASK)] = group
    cmd.remove("--no-progress")  # the bar's last update came after the last request (a NameError once)
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    sub = json.load(open(out / "results.json"))
    assert sub["results"][TASK]["exact_match,none"] == results["results"][TASK]["exact_match,none"]
    assert sub["results"][group]["exact_match,none"] == results["results"][TASK]["exact_match,none"]
    for key in ("nfe", "non_eos_tokens", "tpf"):
        assert sub["polestar_jax"]["total"][key] == results["polestar_jax"]["total"][key]
        assert sub["polestar_jax"]["tasks"][group][key] == results["polestar_jax"]["tasks"][TASK][key]
    assert [s["resps"] for s in _samples(out)] == [s["resps"] for s in samples]
    assert "tok/s" not in r.stdout and "tok/s" in r.stderr  # the progress bar goes to stderr
    before = (out / "results.json").read_bytes()
    r2 = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    _one_error_line(r2.returncode, r2.stdout, r2.stderr, "already exists")
    assert (out / "results.json").read_bytes() == before


# ------------------------------------------------------------------------------------ the model class


@pytest.fixture(scope="module")
def tiny():
    from polestar_jax.api import load

    return load(compile_cache=False)


def _requests(tiny, items, **gen_kwargs):
    """lm-eval requests of the local task (chat-rendered contexts, doc ids in order)."""
    reqs = []
    for i, (_, p, _) in enumerate(items):
        ctx = tiny.tokenizer.apply_chat_template([{"role": "user", "content": p}])
        reqs.append(Instance("generate_until", {}, (ctx, dict({"until": [], "max_gen_toks": 32}, **gen_kwargs)),
                             i, metadata=(TASK, i, 1)))
    return reqs


#: the checked dual cache, as bench.run's fastdllm-dual-checked row (its batch-7 / batch-1 executables)
CHECKED = dict(decoder="fastdllm", cache="dual", step_after_full_pass=False, pad_multiple=SLOT, progress=False)


def test_batching_equals_one_at_a_time_and_stop_strings(tiny):
    """Batch 7 (two batches, the last padded) and batch 1 give the same responses and counts; ``until``
    cuts the response at the first stop string; the accounting adds up."""
    items = _items()
    got = {}
    for b in (BATCH, 1):
        lm = PolestarLM(model_obj=tiny, batch_size=b, **CHECKED)
        texts = lm.generate_until(_requests(tiny, items))
        recs = sorted(lm.records, key=lambda r: r["row"])
        got[b] = (texts, [(r["row"], r["nfe"], r["non_eos_tokens"]) for r in recs], lm)
        # one continuous job per group (task, gen length, prompt slot), b rows at once
        assert len(lm.batches) == 1 and lm.batches[0]["rows"] == min(b, len(items))
    assert got[BATCH][0] == got[1][0]
    assert got[BATCH][1] == got[1][1]
    texts, _, lm = got[BATCH]
    assert any("," in t for t in texts)
    cut = lm.generate_until(_requests(tiny, items, until=[",", "zz"]))
    assert cut == [apply_until(t, [","]) for t in texts]
    assert any(c != t for c, t in zip(cut, texts))
    # the official harness's count: the text kept by the stop strings, re-encoded
    last = sorted(lm.records[-len(items):], key=lambda r: r["row"])
    assert all(r["until_tokens"] <= r["non_eos_tokens"] for r in last)
    assert any(r["until_tokens"] < r["non_eos_tokens"] for r in last)
    acct = lm.accounting()["tasks"][TASK]
    assert acct["requests"] == 2 * len(items)
    assert acct["tpf"] == pytest.approx(acct["non_eos_tokens"] / acct["nfe"])
    # apply_until=false returns whole responses
    whole = PolestarLM(model_obj=tiny, batch_size=BATCH, apply_until=False, **CHECKED)
    assert whole.generate_until(_requests(tiny, items, until=[","])) == texts


def test_max_gen_toks_rounds_up_to_blocks(tiny):
    assert [gen_length_for(m, 8) for m in (1, 8, 20, 32, 33)] == [8, 8, 24, 32, 40]
    assert gen_length_for(256, 32) == 256 and gen_length_for(300, 32) == 320
    lm = PolestarLM(model_obj=tiny, decoder="fastdllm", cache="none", progress=False)
    assert lm.block_length == 8  # the folder's generation default
    assert lm.gen_length({"max_gen_toks": 20}) == 24 and lm.gen_length({}) == 256  # lm-eval's default 256
    assert PolestarLM(model_obj=tiny, gen_length=16, progress=False).gen_length({"max_gen_toks": 200}) == 16
    assert PolestarLM(model_obj=tiny, block_length=4, progress=False).gen_length({"max_gen_toks": 10}) == 12
    lm.generate_until(_requests(tiny, _items()[:1], max_gen_toks=20))
    assert lm.records[0]["gen_length"] == 24 and lm.batches[0]["gen_length"] == 24
    too_long = _requests(tiny, _items()[:1], max_gen_toks=250)
    with pytest.raises(PolestarError, match="max_sequence_length"):
        lm.generate_until(too_long)


def test_model_args_parsing():
    """lm-eval's parsed values (None for 'none', numbers as numbers or strings), aliases, the mesh spelling."""
    own, knobs = parse_model_args({"pretrained": "/m", "mesh": "data=2;model=4", "cache": None, "threshold": None,
                                   "clusters": 4, "device": "cuda:0", "seed": "7", "apply_until": "false"})
    assert own["model"] == "/m" and own["mesh"] == "data=2,model=4" and own["seed"] == 7
    assert own["apply_until"] is False
    assert knobs == {"cache": "none", "threshold": None, "n_clusters": 4}


@pytest.mark.parametrize("args, needle", [
    ("threshold=abc", "threshold='abc' is not a number"),
    ("top_k=2.5", "top_k=2.5 is not an integer"),
    ("bogus=1", "unknown argument 'bogus'"),
    ("decoder=fastdllm,top_k=2", "decoder polestar only"),
    ("decoder=nope", "unknown decoder"),
    ("mc_num=10,mc_batch=3", "does not divide"),
    ("batch_size=0", "batch_size must be >= 1"),
    ("gen_length=30,block_length=8", "not a multiple of block length"),
])
def test_bad_model_args_one_line(args, needle):
    with pytest.raises(PolestarError) as e:
        PolestarLM.create_from_arg_string(args)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_cli_bad_input_one_line(tmp_path, capsys):
    base = ["--output-path", str(tmp_path / "o"), "--tasks", TASK, "--include-path", str(LOCAL)]
    _one_error_line(*_main(base + ["--model-args", "top_k=abc"], capsys), "top_k='abc' is not an integer")
    _one_error_line(*_main(base + ["--decoder", "llada", "--top-k", "2"], capsys), "polestar only")
    _one_error_line(*_main(["--output-path", str(tmp_path / "o"), "--tasks", "humaneval"], capsys),
                    "--allow-code-execution")
    _one_error_line(*_main(base + ["--model", str(tmp_path / "missing")], capsys), "not found")
    _one_error_line(*_main(base + ["--preset", "paper-1024"], capsys), "invalid choice")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "results.json").write_text("{}")
    _one_error_line(*_main(["--output-path", str(tmp_path / "done"), "--tasks", TASK], capsys), "already exists")
    assert not (tmp_path / "o").exists()


def test_presets_follow_the_official_protocol(tiny):
    """gt-synergy-lab/Polestar configs/evaluation/text.json + configs/llada8b.json + evaluation/run.py."""
    for gen in (256, 512):
        p = ev.PRESETS[f"paper-{gen}"]
        assert p.num_fewshot == {"gsm8k": 5, "minerva_math": 4, "humaneval": 0, "mbpp": 3}
        own, knobs = parse_model_args(p.model_args)
        assert knobs == {"decoder": "polestar", "cache": "dual", "gen_length": gen, "block_length": 32,
                         "threshold": 0.9, "early_threshold": 0.7}
        assert own["batch_size"] == 1 and p.seed == 42 and p.apply_chat_template and not p.fewshot_as_multiturn
        d = PolestarLM(model_obj=tiny, **p.model_args).decode_config(gen)
        assert (d.decoder, d.cache, d.gen_length, d.block_length, d.steps, d.threshold) == (
            "polestar", "dual", gen, 32, gen, 0.9)
        assert d.polestar.early_threshold == 0.7 and d.polestar == PolestarConfig(early_threshold=0.7)
    # the flags override the preset; another decoder drops Polestar's knobs (llada: the threshold too)
    for dec, extra in (("fastdllm", ["--threshold", "0.8"]), ("llada", [])):
        args = ev.build_parser().parse_args(["--tasks", "gsm8k", "--output-path", "x", "--preset", "paper-512",
                                             "--decoder", dec, "--seed", "3", *extra])
        ma = ev.model_args_from(args, ev.PRESETS["paper-512"])
        assert ma["decoder"] == dec and ma["gen_length"] == 512 and ma["seed"] == 3 and "early_threshold" not in ma
        d = PolestarLM(model_obj=tiny, **ma).decode_config(512)
        assert (d.decoder, d.cache, d.steps) == ((dec, "dual", 512) if dec == "fastdllm" else (dec, "none", 512))
        assert d.threshold == (0.8 if dec == "fastdllm" else None)


def test_loglikelihood_monte_carlo(tiny):
    """LLaDA's estimator: seeded by (seed, request), deterministic, higher for the right continuation;
    the greedy check; loglikelihood_rolling is a one-line error."""
    ctx = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "copy: ann,bob,cal"}])
    reqs = [Instance("loglikelihood", {}, (ctx, cont), i, metadata=("ll", i, 1))
            for i, cont in enumerate(["ann,bob,cal", "tom,val,pat"])]
    lm = PolestarLM(model_obj=tiny, mc_num=4, mc_batch=2, check_greedy=True, progress=False)
    (good, g_greedy), (bad, b_greedy) = lm.loglikelihood(reqs)
    assert math.isfinite(good) and math.isfinite(bad) and good < 0 and bad < good
    assert b_greedy is False
    # the greedy check itself, on the prompt the model was trained on (lm-eval's split moves the context's
    # trailing "\n\n" into the continuation)
    prefix = tiny.tokenizer.chat_prompt_ids("copy: ann,bob,cal")
    assert lm._greedy_matches(prefix, tiny.tokenizer.encode("ann,bob,cal"))
    assert not lm._greedy_matches(prefix, tiny.tokenizer.encode("tom,val,pat"))
    T_len = len(lm._encode_pair(ctx, "ann,bob,cal")[1])
    assert lm.accounting()["loglikelihood_forwards"] == 2 * (4 // 2 + T_len)  # MC batches + greedy steps
    assert lm.loglikelihood(reqs) == [(good, g_greedy), (bad, b_greedy)]  # same seed, same draws
    other = PolestarLM(model_obj=tiny, mc_num=4, mc_batch=2, seed=1, progress=False).loglikelihood(reqs[:1])
    assert other[0][0] != good and other[0][1] is False  # another seed; check_greedy off: False
    with pytest.raises(PolestarError, match="loglikelihood_rolling"):
        lm.loglikelihood_rolling(reqs)
