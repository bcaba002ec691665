"""``python -m bench.run``: the accuracy-throughput benchmark runs every decoder, the ablations and the threshold
sweep on the same instances and writes results.json / run.json / results.md (smoke size: 3 tasks x 3 instances,
batch 7, the new rows); instance outputs do not depend on the batch size; the H200 projection and the frontier
read-off on hand-made numbers."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bench import common as BC
from bench import run as BR
from bench import tasks as T

# One job shared by the smoke run and the batching test (same items, slot and batch 7: the batch-7
# executables compiled by the smoke run serve the batching test too)
SMOKE_TASKS, SMOKE_N, SMOKE_BATCH = ("copy", "sort", "add"), 3, 7
# Each kind of row once: the baseline, Fast-dLLM's reference and checked loops (compared), one Polestar
# ablation (commit-only: refresh off), Polestar, and the sweep rows. The run is compile-bound (one executable
# per decoder); the other ablation (refresh-only, the costliest compile) is checked as a configuration in
# test_decoders_sweep_names_and_configs.
SMOKE_DECODERS = ("llada", "fastdllm-dual", "fastdllm-dual-checked", "polestar-commit-only", "polestar")
# 0.8 and 0.95 share the unsuffixed rows' executables (the threshold is a run-time knob); 0.7 would compile
# Polestar again (its early threshold changes), so its naming and config are checked without decoding
SMOKE_SWEEP = (0.8, 0.9, 0.95)


def _smoke_items():
    return [(t, p, a) for t in SMOKE_TASKS for p, a in T.eval_instances(t, SMOKE_N)]


def test_bench_run_smoke(tmp_path, capsys):
    out = tmp_path / "res"
    rc = BR.main(["--n", str(SMOKE_N), "--tasks", ",".join(SMOKE_TASKS), "--decoders", ",".join(SMOKE_DECODERS),
                  "--sweep", ",".join(map(str, SMOKE_SWEEP)), "--repeats", "2", "--batch", str(SMOKE_BATCH),
                  "--no-flops", "--no-progress", "--out", str(out)])
    assert rc == 0
    rows = json.load(open(out / "results.json"))
    meta = json.load(open(out / "run.json"))
    gen, block = meta["config"]["gen_length"], meta["config"]["block_length"]
    sweep_names = [f"{b}@{t:g}" for b in BR.SWEPT for t in (0.8, 0.95)]
    names = list(SMOKE_DECODERS) + sweep_names
    assert meta["config"]["decoders_run"] == names  # report order; no "@0.9" row: that is the unsuffixed one
    tasks = SMOKE_TASKS + ("all",)
    assert {(r["decoder"], r["task"]) for r in rows} == {(d, t) for d in names for t in tasks}
    # machine load before and after, and the command
    for key in ("load_before", "load_after"):
        assert len(meta[key]) == 3 and all(v >= 0 for v in meta[key]), meta[key]
    assert meta["command"].startswith("python -m bench.run --n 3")
    # one block program per decoder (batch 7 at one prompt slot, both repeats); the threshold sweep rows
    # reuse their decoder's (the threshold is a run-time knob)
    assert meta["executables_compiled"] == len(SMOKE_DECODERS)
    assert {r["decoder"]: r["executables"] for r in rows if r["task"] == "all"} == {
        n: int(n in SMOKE_DECODERS) for n in names}
    for r in rows:
        for key in ("decoder", "task", "accuracy", "tpf", "tps", "nfe", "gflops_per_token", "tps_h200_projection",
                    "threshold", "forwards_full", "forwards_windowed", "forwards_step", "forwards_refresh"):
            assert key in r, key
        assert 0.0 <= r["accuracy"] <= 1.0 and r["tps"] >= 0 and r["gflops_per_token"] > 0
        assert r["tps_h200_projection"] > 0 and r["h200_projection_ms_per_instance"] > 0
        assert r["tps_h200_projection_b32"] > r["tps_h200_projection"]  # batching amortises the weights
        assert r["n"] == (SMOKE_N * len(SMOKE_TASKS) if r["task"] == "all" else SMOKE_N)
        mix = r["forwards_full"] + r["forwards_windowed"] + r["forwards_step"] + r["forwards_refresh"]
        assert mix == pytest.approx(r["nfe"]), r  # every forward has a kind
    by = {(r["decoder"], r["task"]): r for r in rows}
    allr = {d: by[(d, "all")] for d in names}
    # llada commits one token per forward: at most gen_length forwards per instance (early exit stops a row
    # after the block holding its first stop token), all full passes
    for t in tasks:
        assert 0 < by[("llada", t)]["nfe"] <= gen and by[("llada", t)]["forwards_full"] == by[("llada", t)]["nfe"]
        assert by[("llada", t)]["tpf"] <= 1.0 + 1e-9
    # the checked dual-cache loop only drops the forward after a block-filling full pass: same tokens
    for t in tasks:
        chk, ref = by[("fastdllm-dual-checked", t)], by[("fastdllm-dual", t)]
        assert chk["accuracy"] == ref["accuracy"] and chk["non_eos_tokens"] == ref["non_eos_tokens"]
        # (one full pass per decoded block; early exit: a row decodes 1 .. gen / block blocks)
        assert chk["nfe"] <= ref["nfe"] and chk["forwards_full"] == ref["forwards_full"] <= gen // block
        assert chk["forwards_full"] >= 1
    # Polestar: at least one forward per decoded block, at most one per token plus the block starts
    pol = allr["polestar"]
    assert 1 <= pol["nfe"] <= gen + gen // block
    assert 0.0 <= pol["refresh_rate"] <= 1.0 and "early_commits" in pol
    assert pol["forwards_refresh"] == pol["refresh_steps"] > 0 and 0 < pol["refresh_rows_computed"] <= 3 * block
    # the ablation: commit-only never refreshes (nor pre-commits suffix rows)
    for t in tasks:
        co = by[("polestar-commit-only", t)]
        assert co["refresh_steps"] == 0 and co["forwards_refresh"] == 0 and co["refresh_rate"] == 0
        assert co["suffix_commits"] == 0 and co["early_threshold"] == 0.7
    # sweep rows: named with their threshold, on their decoder's curve with the unsuffixed 0.9 row
    for b in BR.SWEPT:
        assert allr[b]["curve"] == b and allr[b]["threshold"] == 0.9
        for t in (0.8, 0.95):
            r = allr[f"{b}@{t:g}"]
            assert r["curve"] == b and r["threshold"] == t and r["repeats"] == 1
    assert allr["polestar@0.8"]["early_threshold"] == 0.7
    # tokens/s of the unsuffixed rows: over the median decode time of the repeats, whose tokens agree
    for d in SMOKE_DECODERS:
        r = allr[d]
        assert r["repeats"] == 2 and len(r["tps_runs"]) == 2 and r["repeat_outputs_identical"] is True
        assert r["tps"] == pytest.approx(r["non_eos_tokens"] / float(np.median(r["decode_seconds_runs"])))
    for d in names:
        tasks_acc = [by[(d, t)]["accuracy"] for t in SMOKE_TASKS]
        assert allr[d]["accuracy"] == pytest.approx(np.mean(tasks_acc))
    md = open(out / "results.md").read()
    assert "| llada |" in md and "| polestar |" in md and "| polestar@0.95 |" in md and "Accuracy per task" in md
    assert "Frontier read-off" in md and "projection" in md and "MODEL" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert os.path.getsize(out / "frontier.png") > 1000


#: Decoders whose outputs the batching test compares: by default the checked dual cache (a deterministic
#: decoder) and Polestar (random k-means draws, refresh widths chosen per batch); BENCH_BATCHING_ALL=1 takes
#: every decoder of bench.run (several minutes on 2 cores: each needs two more compiles).
BATCHING_DECODERS = (BR.DECODER_NAMES if os.environ.get("BENCH_BATCHING_ALL") == "1"
                     else ("fastdllm-dual-checked", "polestar"))


@pytest.fixture(scope="module")
def tiny_tasks_model():
    return BC.load_bench_model()


@pytest.mark.parametrize("name", BATCHING_DECODERS)
def test_outputs_do_not_depend_on_batching(tiny_tasks_model, name):
    """Instance i decodes as row i of the job (key (seed, i)): batch sizes 7 (two batches, the last padded),
    1 and 72 (one padded batch) give the same tokens, forwards and Polestar decisions."""
    bm = tiny_tasks_model
    items = _smoke_items()
    slot = BC.prompt_slot([bm.tok.chat_prompt_ids(p) for _, p, _ in items])
    d = next(x for x in BR.DECODERS if x.name == name)
    keys = ("nfe", "refresh", "early", "suffix", "full", "windowed", "step", "refresh_rows")
    got = {}
    for batch in (SMOKE_BATCH, 1, 72):
        res = BR.run_decoder(bm.engine, bm.tok, d, items, bm.gen_length, bm.block_length, batch, slot, seed=0)
        got[batch] = res
        assert res["tokens"].shape == (len(items), bm.gen_length)
    for batch in (1, 72):
        np.testing.assert_array_equal(got[batch]["tokens"], got[SMOKE_BATCH]["tokens"], err_msg=f"batch {batch}")
        for k in keys:
            assert got[batch][k] == got[SMOKE_BATCH][k], (batch, k)


def test_padded_batches_keep_job_rows():
    prompts = [[i + 1] for i in range(9)]
    got = list(BC.padded_batches(prompts, 4))
    assert [n for n, _, _ in got] == [4, 4, 1]
    assert [rows for _, _, rows in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 8, 8, 8]]
    assert got[-1][1] == [[9]] * 4
    assert BC.prompt_slot([[1] * 17, [1] * 3]) == 32 and BC.prompt_slot([[1] * 16]) == 16


def test_decoders_sweep_names_and_configs():
    decs = BR.resolve_decoders(BR.DECODER_NAMES, BR.SWEEP_THRESHOLDS)
    names = [d.name for d in decs]
    assert names[:len(BR.DECODER_NAMES)] == list(BR.DECODER_NAMES)
    assert names[len(BR.DECODER_NAMES):] == [f"{b}@{t}" for b in BR.SWEPT for t in ("0.7", "0.8", "0.95")]
    for name in ("fastdllm-dual", "fastdllm-dual-checked", "polestar-refresh-only", "polestar-commit-only"):
        assert name in BR.DECODER_NAMES
    by = {d.name: d for d in decs}
    cfg = {n: BR.decode_config(d, 32, 8) for n, d in by.items()}  # every one validates
    assert cfg["fastdllm-dual"].step_after_full_pass and not cfg["fastdllm-dual-checked"].step_after_full_pass
    assert not cfg["fastdllm-dual-checked@0.7"].step_after_full_pass
    co, ro = cfg["polestar-commit-only"].polestar, cfg["polestar-refresh-only"].polestar
    assert (co.refresh, co.suffix_precommit, co.early_threshold) == (False, False, 0.7)
    assert (ro.refresh, ro.suffix_precommit, ro.early_threshold) == (True, False, None)
    # Polestar's early threshold in the sweep: the default 0.7 below the threshold, else threshold - 0.2
    assert [cfg[f"polestar@{t}"].polestar.early_threshold for t in ("0.7", "0.8", "0.95")] == [0.5, 0.7, 0.7]
    assert cfg["polestar"].polestar.early_threshold == 0.7 and cfg["polestar@0.7"].threshold == 0.7
    assert by["polestar@0.8"].sweep_point and not by["polestar"].sweep_point and by["polestar"].curve == "polestar"
    # explicit sweep names; the 0.9 point is the unsuffixed decoder
    assert [d.name for d in BR.resolve_decoders(["polestar@0.85", "polestar@0.9"], ())] == ["polestar@0.85",
                                                                                           "polestar"]
    for bad in ("fastdllm@0.8", "polestar@x", "polestar@1.5", "nope"):
        with pytest.raises(BR.PolestarError):
            BR.resolve_decoders([bad], ())


def test_variant_rows_change_only_the_given_knobs():
    d = BR.variant_decoder("--top-k 8 --suffix-blocks 2 --early-threshold none")
    assert d.name == "polestar[suffix_blocks=2,top_k=8,early_threshold=none]"  # field order
    pc, ref = BR.decode_config(d, 128, 32).polestar, BR.PolestarConfig()
    assert (pc.top_k, pc.suffix_blocks, pc.early_threshold) == (8, 2, None)
    assert (pc.top_k_last, pc.prefix_blocks, pc.trigger_commits) == (ref.top_k_last, ref.prefix_blocks,
                                                                      ref.trigger_commits)
    assert d.sweep_point and d.curve is None and d.threshold == 0.9
    assert BR.variant_decoder("--no-refresh --no-suffix-commit").polestar["refresh"] is False
    names = [x.name for x in BR.resolve_decoders(["llada"], (0.8,), ["--top-k 2"])]
    assert names == ["llada", "polestar[top_k=2]"]
    for bad in ("", "--nope 3", "--top-k x", "--top-k 9", "--no-refresh", "'--top-k"):
        with pytest.raises(BR.PolestarError):
            BR.variant_decoder(bad)
    with pytest.raises(BR.PolestarError, match="twice"):
        BR.resolve_decoders([], (), ["--top-k 2", "--top-k  2"])


def test_bench_run_rejects_unknown_names(capsys):
    assert BR.main(["--decoders", "nope", "--n", "1", "--out", ""]) == 2
    assert "unknown decoder" in capsys.readouterr().err
    assert BR.main(["--decoders", "llada@0.8", "--n", "1", "--out", ""]) == 2
    assert "no threshold sweep" in capsys.readouterr().err
    assert BR.main(["--tasks", "nope", "--n", "1", "--out", ""]) == 2
    assert "unknown task" in capsys.readouterr().err
    assert BR.main(["--variant", "--top-k 9", "--n", "1", "--out", ""]) == 2
    assert "top_k 9 is larger" in capsys.readouterr().err
    assert BR.main(["--variant=--nope", "--n", "1", "--out", ""]) == 2
    assert "--variant: unrecognized arguments: --nope" in capsys.readouterr().err


def test_task_groups_expand():
    assert BR.expand_tasks("long") == T.LONG_TASK_NAMES
    assert BR.expand_tasks("copy,tiny_tasks") == T.TASK_NAMES  # in place, duplicates dropped
    assert BR.expand_tasks("long_copy, sort") == ("long_copy", "sort")


def test_h200_projection_model():
    """The projection prices each forward kind with bench.gpu_check's models at LLaDA-8B shapes, batch 1."""
    from bench import gpu_check as G

    slot, gen, block = 64, 32, 8
    cost = lambda kind, rows=None: BR._roofline(slot, gen, block, kind, rows)["seconds"]
    # batch 1 at this layout: every forward reads the 8B weights once, ~16 GB / 4.8 TB/s
    assert 2.5e-3 < cost("dual_step") < 5e-3 and BR._roofline(slot, gen, block, "dual_step", None)["bound"] == "memory"
    assert cost("full") >= cost("prefix_step") >= cost("dual_step") > 0
    assert cost("polestar_refresh_step", 8.0) < cost("polestar_refresh_step", 24.0)
    assert cost("polestar_refresh_step") == cost("polestar_refresh_step", 24.0)  # default: all R window rows
    assert cost("polestar_step") <= cost("polestar_refresh_step", 6.0)
    cfg, _ = G.model_config(G.CheckConfig(layers=32, prompt_length=slot, gen_length=gen, block_length=block))
    with pytest.raises(ValueError):
        G.shape_info("dual_step", cfg, G.CheckConfig(), refresh_rows=3)
    mix = {"full": 3, "windowed": 1, "step": 2, "refresh_rows": [8.0, 16.0]}
    p = BR.h200_projection("polestar", "dual", mix, slot, gen, block)
    want = (3 * cost("polestar_start") + cost("polestar_windowed_start") + 2 * cost("polestar_step")
            + cost("polestar_refresh_step", 8.0) + cost("polestar_refresh_step", 16.0))
    assert p["seconds"] == pytest.approx(want)
    f = BR.h200_projection("fastdllm", "none", {"full": 5, "windowed": 0, "step": 0, "refresh_rows": []},
                           slot, gen, block)
    assert f["seconds"] == pytest.approx(5 * cost("full"))
    # batch 32: each forward is a 32nd of a batch forward of its kind; the weights are read once per batch,
    # so a row's share is cheaper, and the refresh rows' FLOPs weigh more than at batch 1
    b32 = BR.h200_projection("polestar", "dual", mix, slot, gen, block, batch=32)
    cost32 = lambda kind, rows=None: BR._roofline(slot, gen, block, kind, rows, 32)["seconds"] / 32
    assert b32["seconds"] == pytest.approx(3 * cost32("polestar_start") + cost32("polestar_windowed_start")
                                           + 2 * cost32("polestar_step") + cost32("polestar_refresh_step", 8.0)
                                           + cost32("polestar_refresh_step", 16.0))
    assert b32["seconds"] < p["seconds"]
    share = lambda q: q["seconds_by_kind"]["refresh"] / q["seconds_by_kind"]["step"]
    assert share(b32) > share(p)  # refresh rows stop being free where the batch is compute-bound


def test_gpu_check_times_next_to_the_projection(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({
        "device_kind": "NVIDIA H200", "is_gpu": True, "date": "d",
        "config": {"prompt_length": 64, "gen_length": 32, "block_length": 8},
        "results": [{"kind": "dual_step", "kernels": "none", "status": "ok", "est_model_depth_ms": 6.0},
                    {"kind": "polestar_step", "kernels": "pallas", "status": "error"}]}))
    g = BR.gpu_check_table(str(path), 64, 32, 8)
    assert g["matches_run_layout"] and [k["kind"] for k in g["kinds"]] == ["dual_step"]
    k = g["kinds"][0]
    assert k["projected_ms"] == pytest.approx(1e3 * BR._roofline(64, 32, 8, "dual_step", None)["seconds"])
    assert k["measured_over_projected"] == pytest.approx(6.0 / k["projected_ms"])
    assert not BR.gpu_check_table(str(path), 80, 32, 8)["matches_run_layout"]
    with pytest.raises(BR.PolestarError):
        BR.gpu_check_table(str(tmp_path / "missing.json"), 64, 32, 8)


def _pt(decoder, curve, t, acc, tpf, tps=100.0):
    return {"decoder": decoder, "task": "all", "curve": curve, "threshold": t, "accuracy": acc, "tpf": tpf,
            "tps": tps, "tps_h200_projection": 10 * tpf}


def test_frontier_readoff_interpolates_at_matched_accuracy():
    base = [_pt(f"fastdllm-dual-checked@{t}", "fastdllm-dual-checked", t, a, f)
            for t, a, f in ((0.7, 0.50, 3.0), (0.8, 0.60, 2.5), (0.95, 0.72, 1.5))]
    base.append(_pt("fastdllm-dual-checked", "fastdllm-dual-checked", 0.9, 0.70, 2.0))
    pol = [_pt("polestar", "polestar", 0.9, 0.65, 2.5, tps=50.0), _pt("polestar@0.95", "polestar", 0.95, 0.80, 1.0)]
    ro = BR.frontier_readoff(base + pol + [dict(_pt("polestar", None, 0.9, 0.1, 1.0), task="copy")])
    assert [p["threshold"] for p in ro] == [0.9, 0.95]
    p = ro[0]
    assert p["base_at_accuracy"]["tpf"] == pytest.approx(2.25) and p["base_at_accuracy"]["between"] == (0.8, 0.9)
    assert p["tpf_ratio_at_accuracy"] == pytest.approx(2.5 / 2.25)
    assert p["tps_ratio_at_accuracy"] == pytest.approx(0.5)
    assert p["tpf_ratio_same_threshold"] == pytest.approx(2.5 / 2.0)
    assert ro[1]["base_at_accuracy"] is None and ro[1]["tpf_ratio_at_accuracy"] is None  # above its range
    assert BR.frontier_readoff(pol) == []


def test_every_task_instance_fits_the_trained_layout():
    """The benchmark's instances fit the bundled model's answer length (answers + EOS <= gen_length)."""
    from polestar_jax.io.checkpoint import generation_defaults
    from polestar_jax.io.tokenizer import bundled_model_dir

    gen = generation_defaults(bundled_model_dir()).get("gen_length", 32)
    for task in T.TASK_NAMES:
        for _, a in T.eval_instances(task, 50):
            assert len(a.encode()) < gen


def test_bundled_model_solves_the_tasks_it_learned():
    """The shipped tiny_tasks model answers held-out copy / reverse instances (100% when exported, see its
    README) -- a corrupted or mis-exported checkpoint fails here."""
    from polestar_jax.io.checkpoint import load_model
    from polestar_jax.config import DecodeConfig
    from engines import generate  # tests/engines.py
    from polestar_jax.io.tokenizer import bundled_model_dir, load_tokenizer

    cfg, params = load_model(bundled_model_dir())
    tok = load_tokenizer(bundled_model_dir())
    items = [(t, p) for t in ("copy", "reverse") for p, _ in T.eval_instances(t, 8, start=500)]
    dc = DecodeConfig(decoder="llada", cache="none", gen_length=32, block_length=8, steps=32, threshold=None)
    res = generate(params, cfg, [tok.chat_prompt_ids(p) for _, p in items], dc, seed=0)
    hits = [T.score(t, p, T.decode_answer(tok, res.tokens[i])) for i, (t, p) in enumerate(items)]
    assert sum(hits) >= 15, hits


def test_probe_commits_sorts_commits_by_kind(capsys):
    """``bench.probe_commits`` on the smoke job (its executables): the kind rule on a hand-made row; the early
    mask read from the per-block StepOut buffers counts exactly the early commits the engine counted; and on
    the probe's own decode the checked dual cache commits nothing early or ahead of its block, every wrong
    answer has one first wrong token, and the accuracy agrees with :func:`bench.run.run_decoder`."""
    from bench import probe_commits as PC

    # blocks of 2 tokens: block 0 took forwards 0-2, block 1 forwards 3-4; position 2 was committed at
    # forward 1 (during block 0: a suffix commit), position 1 by the early rule
    kinds = PC.commit_kinds(np.array([0, 2, 1, 3]), np.array([3, 2]), np.array([False, True, False, False]), 2)
    assert [PC.KINDS[k] for k in kinds] == ["rule", "early", "suffix", "rule"]

    names = ["fastdllm-dual-checked", "polestar-commit-only"]
    bm = BC.load_bench_model(None)
    G, B = bm.gen_length, bm.block_length
    items = _smoke_items()
    prompts = [bm.tok.chat_prompt_ids(p) for _, p, _ in items]
    slot = BC.prompt_slot(prompts)
    early = 0
    d = BR.resolve_decoders(["polestar-commit-only"], ())[0]
    for _, n_real, out in BC.decode_batches(bm.engine, prompts, BR.decode_config(d, G, B), SMOKE_BATCH,
                                            slot):
        for r in range(n_real):
            mask = PC.early_mask(out.steps, r, G, B)
            assert mask.sum() == out.polestar["early"][r]
            assert (out.commit_step[r][mask] >= 0).all()
            early += int(mask.sum())
    assert early > 0  # the job has early commits to find

    res = PC.probe("", SMOKE_TASKS, names, SMOKE_N, batch=SMOKE_BATCH)
    for d in BR.resolve_decoders(names, ()):
        ref = BR.run_decoder(bm.engine, bm.tok, d, items, G, B, SMOKE_BATCH, slot, 0)
        for i, task in enumerate(SMOKE_TASKS):
            s = res[d.name][task]
            assert s["answers"] == SMOKE_N
            correct = ref["correct"][i * SMOKE_N:(i + 1) * SMOKE_N]
            assert s["accuracy"] == pytest.approx(np.mean(correct))
            assert sum(s["first_wrong"].values()) == SMOKE_N - sum(correct)
            assert s["suffix"]["tokens"] == 0  # no refresh, no suffix commits
            if d.decoder != "polestar":
                assert s["early"]["tokens"] == 0 and s["rule"]["tokens"] > 0
    assert PC.main(["--model", "", "--tasks", "nope"]) == 2
    assert "unknown task(s) nope" in capsys.readouterr().err
