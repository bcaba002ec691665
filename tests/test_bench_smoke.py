"""Smoke test of ``bench/bench_decoders.py``: its quick path, in-process, on an even tinier model."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # ``bench`` is a top-level folder of the repo, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from bench import bench_decoders as B  # noqa: E402

TINY = dataclasses.replace(
    B.QUICK, name="smoke", n_layers=1, d_model=64, n_heads=2, mlp_hidden=128, vocab=512,
    prompt_length=16, gen_length=64, block_length=32, steps=4, peak_scale=40.0,
    forward_warmup=1, forward_reps=1,
    flops=False, param_init="numpy")  # fewer compiles: no unrolled cost analysis, no threefry init


def test_bench_quick_path_tiny(tmp_path):
    result = B.run_bench(TINY, str(tmp_path), command="test")
    with open(tmp_path / "bench_decoders.json") as f:
        data = json.load(f)
    assert data["machine"]["cpu_count"] and data["machine"]["jax_version"] and data["date"]

    rows = data["decoders"]
    want = {(d, c) for d, c, _ in B.DECODERS}
    variants = {r["variant"] for r in rows}
    assert variants == {"random", "peaked"}
    for v in variants:
        vrows = [r for r in rows if r["variant"] == v]
        assert len(vrows) == len(B.DECODERS)  # one row per decoder
        assert {(r["decoder"], r["cache"]) for r in vrows} == want
    min_nfe = TINY.gen_length // TINY.block_length
    for r in rows:
        assert r["tokens_per_s"] > 0, r
        assert r["nfe"] >= min_nfe, r
        assert r["all_committed"], r
        assert abs(r["tpf"] - TINY.gen_length / r["nfe"]) < 1e-9
    llada = [r for r in rows if r["decoder"] == "llada"]
    assert all(r["nfe"] == TINY.steps for r in llada)  # fixed schedule: exactly `steps` forwards

    kinds = {f["kind"]: f for f in data["forwards"]}
    assert set(kinds) == {"full", "prefix_step", "dual_step", "polestar_step", "polestar_refresh_step"}
    # a refresh step computes more rows than a plain step
    assert kinds["polestar_refresh_step"]["query_rows"] > kinds["polestar_step"]["query_rows"]
    assert all(r["gflops_per_token"] > 0 for r in rows)
    assert "refresh step / plain dual-cache step" in B.markdown(result)
    assert all(f["ms_median"] > 0 for f in kinds.values())
    assert "| model variant | decoder | cache |" in B.markdown(result)


def test_bench_dream_rows_tiny(tmp_path):
    """``--family dream``: a random Dream-architecture model (q/k/v biases, GQA) decoded by Dream's samplers
    (no cache, the dual-cache loop with the threshold and the entropy schedule, Polestar with the family's
    parameters); each row commits every token and the forward kinds are costed."""
    bc = dataclasses.replace(TINY, name="smoke-dream", family="dream", n_kv_heads=1)
    cfg = bc.model_config()
    assert cfg.family == "dream" and cfg.include_qkv_bias and (cfg.n_heads, cfg.n_kv_heads) == (2, 1)
    assert "bq" in B.make_params(bc, cfg)["random"]["blocks"]
    data = B.run_bench(bc, str(tmp_path), command="test")
    assert data["config"]["family"] == "dream"
    rows = data["decoders"]
    assert {r["variant"] for r in rows} == {"random", "peaked"}
    labels = [lab for _, _, _, lab, _ in B.DREAM_DECODERS]
    for v in ("random", "peaked"):
        assert [r["label"] for r in rows if r["variant"] == v] == labels
    for r in rows:
        assert r["all_committed"] and r["tokens_per_s"] > 0 and r["gflops_per_token"] > 0, r
        assert r["nfe"] >= TINY.gen_length // TINY.block_length, r
    sched = [r for r in rows if r["label"] == "dream-dual-entropy"]
    assert sched and all(r["nfe"] == TINY.steps for r in sched)  # the schedule fills a block at its last step
    assert all("refresh_steps" in r for r in rows if r["decoder"] == "polestar")
    assert "dream-polestar" in B.markdown(data) and "(dream)" in B.markdown(data)


def test_bench_engine_mixed_job_smoke(tmp_path):
    """``bench.bench_engine`` on a tiny mixed job (Fast-dLLM dual cache, batch 4): the three modes decode the
    same answers, the long instances are spread through the job, and the continuous job's TPF is at least
    the fixed batches' (early exit never adds a forward)."""
    from bench import bench_engine as BE
    from bench import tasks as T

    items = [(t, p, a) for t in ("copy", "sort") for p, a in T.eval_instances(t, 3)]
    mixed = BE.mixed_items(items, 2)
    longs = [i for i, it in enumerate(mixed) if it[1].count(",") == 8]
    assert len(mixed) == 8 and len(longs) == 2 and longs[0] > 0 and longs[1] > longs[0] + 1
    out = tmp_path / "be.json"
    assert BE.main(["--tasks", "copy,sort", "--n", "3", "--mixed", "2", "--batch", "4", "--lockstep-early-exit",
                    "--decoders", "fastdllm-dual-checked", "--out", str(out)]) == 0
    r = json.load(open(out))["decoders"]["fastdllm-dual-checked"]
    assert r["answers_differing"] == 0
    assert {"fixed", "lockstep_early_exit", "continuous"} <= set(r)
    assert r["continuous"]["tpf"] >= r["fixed"]["tpf"] and r["lockstep_early_exit"]["nfe"] <= r["fixed"]["nfe"]
    assert r["continuous"]["non_eos_tokens"] == r["fixed"]["non_eos_tokens"]


def test_compile_ablations_are_the_flags_they_run_with():
    """bench_compile's Polestar ablations time in one process the config its cache-hit runs pass to
    ``generate`` as flags: both spellings must resolve to the same PolestarConfig."""
    from bench import bench_compile as C
    from polestar_jax.generate import build_parser, decode_config_from_args

    for name, fields in C.ABLATIONS.items():
        args = build_parser().parse_args(["--decoder", "polestar", *C.ablation_flags(fields)])
        got = decode_config_from_args(args).polestar
        assert got == C.decoder_settings(name)["polestar"], name
        assert all(getattr(got, k) == v for k, v in fields.items())


def test_compile_bench_builds_every_decoder():
    """Every row bench_compile can time is a valid decode configuration (its LLaDA row once asked for the
    dual cache, which LLaDA does not have)."""
    from bench import bench_compile as C

    for name in [*C.DECODERS, *C.ABLATIONS]:
        dcfg = C.decode_config(name, 32, 8)
        assert dcfg.decoder == C.decoder_settings(name)["decoder"], name


def test_compile_counts_each_fused_body_once():
    """bench_compile's distinct_fusions: fusions that compute the same thing on arrays of the same shape count
    once (XLA compiles one kernel for them), another shape is another kernel."""
    import re

    import jax
    import jax.numpy as jnp

    from bench.bench_compile import distinct_fusions

    f = lambda a, b, c: (jnp.sin(a) * 2 + 1, jnp.sin(b) * 2 + 1, jnp.sin(c) * 2 + 1)
    text = jax.jit(f).lower(jnp.ones(4), jnp.ones(4), jnp.ones(5)).compile().as_text()
    assert len(re.findall(r"= [^\n]*? fusion\(", text)) == 3
    assert distinct_fusions(text) == 2


def test_serve_load_ratios_are_taken_within_a_round():
    """bench.serve_load's ratio to the fixed batches pairs each round's server run with that round's best fixed
    batch (the machine's speed drifts between rounds), and the reported run is the median one."""
    from bench import serve_load as S

    tps = lambda x: {"tokens_per_s": x}
    rounds = [{"server": {32: tps(90.0)}, "fixed": {1: tps(50.0), 32: tps(100.0)}},
              {"server": {32: tps(45.0)}, "fixed": {1: tps(20.0), 32: tps(50.0)}}]
    assert [S.paired_ratio(r, "server", 32) for r in rounds] == [0.9, 0.9]  # (not 45 / 100 or 90 / 50)
    runs = [{"tokens_per_s": x} for x in (3.0, 1.0, 2.0)]
    assert S.median_run(runs)["tokens_per_s"] == 2.0 and S.median_run(runs)["tokens_per_s_runs"] == [1.0, 2.0, 3.0]
