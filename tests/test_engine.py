"""The decode engine: golden LLaDA / Fast-dLLM generations, the compile cache, termination, sampling, batching,
and :class:`DecodeConfig` validation.

Compile budget: every generation of the golden cases uses one prompt slot (48), so the 117 cases need one
executable per (sampler, rule, gen/block/steps) = 21; the other tests reuse those shapes wherever they can.
"""
from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from polestar_jax.config import DecodeConfig
from polestar_jax.crosscheck import first_divergence
from engines import engine_for, generate  # tests/engines.py
from polestar_jax.errors import ConfigError, PolestarError

TINY_A_DIR = Path(__file__).parent / "data" / "llada_tiny_a"
SLOT = 48  # prompt slot of every golden-shaped generation (prompts of 12 / 25 / 41 tokens); as conftest


def _load_cases() -> list[dict]:
    with open(TINY_A_DIR / "cases.json") as f:
        return json.load(f)["generate_cases"]


def _groups() -> dict[str, list[str]]:
    """``function/g<gen>_b<block>_s<steps>`` -> case names (3 prompts x thresholds)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for c in _load_cases():
        s = c["settings"]
        groups[f"{c['function']}/g{s['gen_length']}_b{s['block_length']}_s{s['steps']}"].append(c["name"])
    return dict(groups)


GROUPS = _groups()


@pytest.fixture(scope="module")
def cases_by_name(tiny_a_cases) -> dict[str, dict]:
    return {c["name"]: c for c in tiny_a_cases["generate_cases"]}


@pytest.fixture(scope="module")
def prompts(tiny_a_cases) -> list[list[int]]:
    return [p["input_ids"] for p in tiny_a_cases["prompts"]]  # 12, 25, 41 tokens


# ---------------------------------------------------------------------------------------- (a) golden
def test_golden_groups_cover_all_cases(tiny_a_cases):
    assert sum(len(v) for v in GROUPS.values()) == len(tiny_a_cases["generate_cases"]) == 117
    assert len({c["function"] for c in tiny_a_cases["generate_cases"]}) == 4


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_golden_generation(tiny_a_generations, cases_by_name, group):
    """Output ids, NFE and commits per forward (and the whole trajectory) match the PyTorch reference.
    The generations run once per session (``tiny_a_generations`` in conftest: one compile per shape)."""
    failures = []
    for name in GROUPS[group]:
        case = cases_by_name[name]
        prompt = case["prompt_ids"]
        res = tiny_a_generations[name]
        num_blocks = case["settings"]["gen_length"] // case["settings"]["block_length"]
        got = res.tokens[0].tolist()
        problems = []
        if got != case["generated_ids"]:
            first = next((i for i, (a, b) in enumerate(zip(got, case["generated_ids"])) if a != b), None)
            problems.append(f"tokens differ first at generated position {first}")
        if prompt + got != case["output_ids"]:
            problems.append("prompt + tokens != output_ids")
        if int(res.nfe[0]) != case["nfe"]:
            problems.append(f"nfe {int(res.nfe[0])} vs {case['nfe']}")
        if res.commits_per_forward(0) != case["margins"]["commits_per_forward"]:
            problems.append(f"commits per forward {res.commits_per_forward(0)} vs "
                            f"{case['margins']['commits_per_forward']}")
        ours = [[(len(prompt) + p, t) for p, t in step] for step in res.trajectory(0)]
        where = first_divergence(ours, case["trajectory"])
        if where:
            problems.append(where)
        if int(res.block_nfe[0].sum()) != int(res.nfe[0]) or res.block_nfe.shape != (1, num_blocks):
            problems.append(f"block nfe {res.block_nfe[0].tolist()} does not add up to nfe {int(res.nfe[0])}")
        if problems:
            failures.append(f"{name}: " + "; ".join(problems))
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------ (b) compile cache
def test_compile_cache_reuses_executables_per_bucket(tiny_a):
    cfg, params = tiny_a
    rng = np.random.default_rng(0)
    # the golden fastdllm/no-cache shape (threshold 0.8 is only a knob): already compiled when (a) ran first
    dcfg = DecodeConfig(decoder="fastdllm", cache="none", gen_length=32, block_length=8, threshold=0.8)
    p33, p40 = rng.integers(0, 254, 33).tolist(), rng.integers(0, 254, 40).tolist()  # both in the 48 bucket

    compile_cache_size = lambda: engine_for(params, cfg).executable_count  # the shared engine's programs
    n0 = compile_cache_size()
    r1 = generate(params, cfg, [p33], dcfg)
    n1 = compile_cache_size()
    assert n1 in (n0, n0 + 1) and (n1 == n0 + 1) == (r1.compile_seconds > 0)

    r2 = generate(params, cfg, [p40], dcfg)  # another prompt, same padded length: no compile
    assert compile_cache_size() == n1 and r2.compile_seconds == 0
    assert r2.tokens.shape == (1, 32) and r2.tokens.tolist() != r1.tokens.tolist()

    r3 = generate(params, cfg, [p40], dataclasses.replace(dcfg, threshold=0.3))  # a knob: no compile
    assert compile_cache_size() == n1 and r3.compile_seconds == 0

    p70 = rng.integers(0, 254, 70).tolist()  # the 80 bucket: compiles once
    r4 = generate(params, cfg, [p70], dcfg)
    assert compile_cache_size() == n1 + 1 and r4.compile_seconds > 0
    r5 = generate(params, cfg, [p70[:66]], dcfg)
    assert compile_cache_size() == n1 + 1 and r5.compile_seconds == 0


# ----------------------------------------------------------------------------- (c) always-mask model
ALL_SAMPLERS = [
    dict(decoder="llada", cache="none", threshold=None),
    *[dict(decoder="fastdllm", cache=c, threshold=t) for c in ("none", "prefix", "dual") for t in (0.9, None)],
    *[dict(decoder="fastdllm", cache=c, threshold=None, factor=1.0) for c in ("none", "prefix", "dual")],
]


@pytest.mark.parametrize("sampler", ALL_SAMPLERS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_mask_loving_model_terminates(tiny_a, prompts, sampler):
    """A model whose most likely token is always [MASK] still fills every position with real tokens."""
    cfg, params = tiny_a
    bad = dict(params, lm_head=params["lm_head"].at[:, cfg.mask_token_id].set(1e4))
    dcfg = DecodeConfig(gen_length=32, block_length=8, steps=32, **sampler)
    res = generate(bad, cfg, [prompts[0]], dcfg, prompt_slot=SLOT)  # golden shapes: no new compile
    tokens, nfe = res.tokens[0], int(res.nfe[0])
    assert not np.any(tokens == cfg.mask_token_id)
    assert np.all(res.commit_step[0] >= 0) and np.all(res.commit_step[0] < nfe)
    assert 0 < nfe <= dcfg.gen_length + 2 * dcfg.num_blocks
    assert int(res.block_nfe[0].sum()) == nfe and np.all(res.block_nfe[0] >= 1)
    assert sum(res.commits_per_forward(0)) == dcfg.gen_length


# --------------------------------------------------------------------------------------- (d) sampling
def test_temperature_sampling_is_seeded(tiny_a, prompts):
    cfg, params = tiny_a
    dcfg = DecodeConfig(decoder="fastdllm", cache="none", gen_length=32, block_length=8, threshold=0.9,
                        temperature=1.0)
    a = generate(params, cfg, [prompts[1]], dcfg, seed=0, prompt_slot=SLOT)
    b = generate(params, cfg, [prompts[1]], dcfg, seed=0, prompt_slot=SLOT)
    c = generate(params, cfg, [prompts[1]], dcfg, seed=1, prompt_slot=SLOT)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.nfe, b.nfe)
    np.testing.assert_array_equal(a.commit_step, b.commit_step)
    assert a.tokens.tolist() != c.tokens.tolist()
    assert not np.any(a.tokens == cfg.mask_token_id) and not np.any(c.tokens == cfg.mask_token_id)
    greedy = generate(params, cfg, [prompts[1]], dataclasses.replace(dcfg, temperature=0.0), prompt_slot=SLOT)
    assert a.tokens.tolist() != greedy.tokens.tolist()


# ---------------------------------------------------------------------------------------- (e) batching
@pytest.mark.parametrize("sampler", [
    dict(decoder="llada", cache="none", threshold=None),
    dict(decoder="fastdllm", cache="none", threshold=0.9),
    dict(decoder="fastdllm", cache="prefix", threshold=0.9),
    dict(decoder="fastdllm", cache="dual", threshold=0.9),
], ids=lambda s: f"{s['decoder']}-{s['cache']}")
def test_batch_equals_single(tiny_a, prompts, cases_by_name, sampler):
    """Two prompts of different lengths decoded together give what each gives alone (and the reference)."""
    cfg, params = tiny_a
    dcfg = DecodeConfig(gen_length=32, block_length=8, steps=32, **sampler)
    short, long_ = prompts[0], prompts[2]  # 12 and 41 tokens
    both = generate(params, cfg, [short, long_], dcfg)  # slot 48 (the longest, rounded up to 16)
    for row, (p, idx) in enumerate([(short, 0), (long_, 2)]):
        alone = generate(params, cfg, [p], dcfg, prompt_slot=SLOT)
        np.testing.assert_array_equal(both.tokens[row], alone.tokens[0], err_msg=f"row {row}")
        assert int(both.nfe[row]) == int(alone.nfe[0]), f"row {row}"
        np.testing.assert_array_equal(both.commit_step[row], alone.commit_step[0], err_msg=f"row {row}")
        np.testing.assert_array_equal(both.block_nfe[row], alone.block_nfe[0], err_msg=f"row {row}")
        fn = {"llada": "llada.generate", "none": "fastdllm.generate",
              "prefix": "fastdllm.generate_with_prefix_cache",
              "dual": "fastdllm.generate_with_dual_cache"}["llada" if sampler["decoder"] == "llada" else sampler["cache"]]
        thr = "none" if sampler["threshold"] is None else sampler["threshold"]
        ref = cases_by_name.get(f"{fn}/p{idx}/g32_b8_s32/thr_{thr}")
        if ref is not None:
            assert both.tokens[row].tolist() == ref["generated_ids"] and int(both.nfe[row]) == ref["nfe"]


# ------------------------------------------------------------------------------- (f) config validation
@pytest.mark.parametrize("kwargs, match", [
    (dict(gen_length=30, block_length=8), "multiple of block length"),
    (dict(gen_length=32, block_length=8, steps=30), "steps"),
    (dict(gen_length=32, block_length=8, steps=0), "steps"),
    (dict(gen_length=0, block_length=8), "positive"),
    (dict(decoder="bogus"), "unknown decoder"),
    (dict(cache="full"), "unknown cache"),
    (dict(remasking="entropy"), "unknown remasking"),
    (dict(decoder="llada", cache="dual", threshold=None), "no cache"),
    (dict(decoder="llada", cache="prefix", threshold=None), "no cache"),
    (dict(decoder="llada", cache="none", threshold=0.9), "threshold"),
    (dict(decoder="llada", cache="none", threshold=None, factor=1.0), "threshold"),
    (dict(threshold=1.5), r"\[0, 1\]"),
    (dict(threshold=-0.1), r"\[0, 1\]"),
    (dict(factor=0.0, threshold=None), "factor"),
    (dict(temperature=-1.0), "temperature"),
])
def test_decode_config_rejects(kwargs, match):
    with pytest.raises(ConfigError, match=match) as e:
        DecodeConfig(**kwargs)
    assert isinstance(e.value, PolestarError) and "\n" not in str(e.value)


def test_decode_config_accepts_edges():
    assert DecodeConfig(decoder="fastdllm", threshold=0.0).rule == "threshold"
    assert DecodeConfig(threshold=1.0).rule == "threshold"
    assert DecodeConfig(decoder="fastdllm", threshold=None).rule == "fixed"
    assert DecodeConfig(decoder="fastdllm", threshold=None, factor=2.0).rule == "factor"
    assert DecodeConfig() == DecodeConfig(decoder="polestar", cache="dual", early_exit=True)  # the CLI's defaults
    d = DecodeConfig(decoder="llada", cache="none", threshold=None, gen_length=64, block_length=16, steps=32)
    assert (d.num_blocks, d.steps_per_block) == (4, 8)
    assert DecodeConfig(gen_length=64, block_length=16).steps == 64


def test_generate_rejects_bad_prompts(tiny_a):
    cfg, params = tiny_a
    dcfg = DecodeConfig(gen_length=32, block_length=8)
    for prompts, match in [([], "no prompt"), ([[1, 2], []], "prompt 1 is empty"),
                           ([[1] * 481], "max_sequence_length"), ([[1, cfg.embedding_size]], "outside"),
                           ([[-1, 2]], "outside")]:
        with pytest.raises(PolestarError, match=match):
            generate(params, cfg, prompts, dcfg)
    with pytest.raises(PolestarError, match="prompt_slot"):
        generate(params, cfg, [[1] * 20], dcfg, prompt_slot=16)


@pytest.mark.parametrize("decoder", ["fastdllm", "polestar_v"])
def test_prefix_cache_steps_write_the_cache_in_place(tiny_a, decoder):
    """A prefix-cache step keeps the K/V rows it writes (no pass reads them before another rewrites them), so
    the compiled block program holds no copy of the whole cache (keeping the old cache beside the step's
    made XLA copy both K and V at every step)."""
    import re

    cfg, params = tiny_a
    eng = engine_for(params, cfg)
    dcfg = DecodeConfig(decoder=decoder, cache="prefix", gen_length=32, block_length=8, threshold=0.9)
    state = eng.initial_state([[5, 6, 7, 8]] * 2, dcfg, 16, 0, [0, 1], [32, 32])
    fn, _ = eng.block_program(params, state, eng.knobs(dcfg), eng.spec(dcfg), None)
    shape = r"\[" + ",".join(map(str, state.k_cache.shape)) + r"\]"
    text = fn.as_text()
    assert re.search(shape, text)  # the cache is in the program
    assert not [ln for ln in text.splitlines() if " copy(" in ln and re.search(shape, ln)]


def test_clear_all_drops_every_live_engines_programs(tiny_a):
    """``Engine.clear_all()``: every referenced engine's compiled programs dropped at once (a process near the
    CPU's mapping limit, docs/usage.md); an engine no longer referenced is not kept alive by it."""
    import gc
    import weakref

    from polestar_jax.engine import engine as engine_mod
    from polestar_jax.engine.engine import Engine

    cfg, params = tiny_a
    dcfg = DecodeConfig(decoder="llada", cache="none", gen_length=8, block_length=8, threshold=None)
    a, b = Engine(params, cfg), Engine(params, cfg)
    for e in (a, b):
        e.run([[5, 6, 7]], dcfg, prompt_slot=16)
        assert e.executable_count > 0
    assert Engine.clear_all() >= 2
    assert a.executable_count == b.executable_count == 0
    gone = weakref.ref(b)
    del b, e
    gc.collect()
    assert gone() is None and a in engine_mod._LIVE
