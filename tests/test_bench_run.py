"""``python -m bench.run``: the accuracy-throughput benchmark runs every decoder on the same instances and
writes results.json / results.md (smoke size: 2 tasks x 2 instances, two decoders)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bench import run as BR
from bench import tasks as T


def test_bench_run_smoke(tmp_path, capsys):
    out = tmp_path / "res"
    rc = BR.main(["--n", "2", "--tasks", "copy,add", "--decoders", "llada,polestar", "--batch", "4",
                  "--no-flops", "--no-progress", "--out", str(out)])
    assert rc == 0
    rows = json.load(open(out / "results.json"))
    meta = json.load(open(out / "run.json"))
    gen, block = meta["config"]["gen_length"], meta["config"]["block_length"]
    assert {(r["decoder"], r["task"]) for r in rows} == {(d, t) for d in ("llada", "polestar")
                                                         for t in ("copy", "add", "all")}
    for r in rows:
        for key in ("decoder", "task", "accuracy", "tpf", "tps", "nfe", "gflops_per_token"):
            assert key in r, key
        assert 0.0 <= r["accuracy"] <= 1.0 and r["tps"] >= 0 and r["gflops_per_token"] > 0
        assert r["n"] == (4 if r["task"] == "all" else 2)
    by = {(r["decoder"], r["task"]): r for r in rows}
    # llada commits one token per forward: exactly gen_length forwards per instance
    for t in ("copy", "add", "all"):
        assert by[("llada", t)]["nfe"] == gen
        assert by[("llada", t)]["tpf"] <= 1.0 + 1e-9
    # Polestar: at least one forward per block, at most one per token plus the block starts
    pol = by[("polestar", "all")]
    assert gen // block <= pol["nfe"] <= gen + gen // block
    assert 0.0 <= pol["refresh_rate"] <= 1.0 and "early_commits" in pol
    for d in ("llada", "polestar"):
        tasks = [by[(d, t)]["accuracy"] for t in ("copy", "add")]
        assert by[(d, "all")]["accuracy"] == pytest.approx(np.mean(tasks))
    md = open(out / "results.md").read()
    assert "| llada |" in md and "| polestar |" in md and "Accuracy per task" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert os.path.getsize(out / "frontier.png") > 1000


def test_bench_run_rejects_unknown_names(capsys):
    assert BR.main(["--decoders", "nope", "--n", "1", "--out", ""]) == 2
    assert "unknown decoder" in capsys.readouterr().err
    assert BR.main(["--tasks", "nope", "--n", "1", "--out", ""]) == 2
    assert "unknown task" in capsys.readouterr().err


def test_every_task_instance_fits_the_trained_layout():
    """The benchmark's instances fit the bundled model's answer length (answers + EOS <= gen_length)."""
    from polestar_jax.checkpoint import generation_defaults
    from polestar_jax.tokenizer import bundled_model_dir

    gen = generation_defaults(bundled_model_dir()).get("gen_length", 32)
    for task in T.TASK_NAMES:
        for _, a in T.eval_instances(task, 50):
            assert len(a.encode()) < gen


def test_bundled_model_solves_the_tasks_it_learned():
    """The shipped tiny_tasks model answers held-out copy / reverse instances (100% when exported, see its
    README) -- a corrupted or mis-exported checkpoint fails here."""
    from polestar_jax.checkpoint import load_model
    from polestar_jax.config import DecodeConfig
    from polestar_jax.engine import generate
    from polestar_jax.tokenizer import bundled_model_dir, load_tokenizer

    cfg, params = load_model(bundled_model_dir())
    tok = load_tokenizer(bundled_model_dir())
    items = [(t, p) for t in ("copy", "reverse") for p, _ in T.eval_instances(t, 8, start=500)]
    dc = DecodeConfig(decoder="llada", cache="none", gen_length=32, block_length=8, steps=32, threshold=None)
    res = generate(params, cfg, [tok.chat_prompt_ids(p) for _, p in items], dc, seed=0)
    hits = [T.score(t, p, T.decode_answer(tok, res.tokens[i])) for i, (t, p) in enumerate(items)]
    assert sum(hits) >= 15, hits
