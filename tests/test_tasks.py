"""The synthetic tasks of bench/tasks: determinism, exact scorers, seed ranges."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from bench import tasks as T


@pytest.mark.parametrize("task", T.TASK_NAMES)
def test_generator_deterministic_per_seed(task):
    a = [T.instance(task, s) for s in range(20)]
    b = [T.instance(task, s) for s in range(20)]
    assert a == b
    assert len(set(a)) > 5  # different seeds give different instances
    r1, r2 = np.random.default_rng(7), np.random.default_rng(7)
    assert [T.TASKS[task].make(r1) for _ in range(5)] == [T.TASKS[task].make(r2) for _ in range(5)]
    assert T.eval_instances(task, 5) == [T.instance(task, T.EVAL_SEED_BASE + i) for i in range(5)]


@pytest.mark.parametrize("task", T.TASK_NAMES)
def test_scorer_accepts_reference(task):
    for prompt, answer in T.eval_instances(task, 200):
        assert T.score(task, prompt, answer), (prompt, answer)
        assert T.score(task, prompt, f" {answer}\n")  # surrounding whitespace is ignored
        assert len(answer) <= T.MAX_ANSWER_CHARS
        assert prompt.isascii() and answer.isascii()


def _corruptions(answer: str, rng: np.random.Generator) -> list[str]:
    out = ["", answer[:-1], answer + "x", answer + ",ann", answer[1:]]
    i = int(rng.integers(len(answer)))
    c = answer[i]
    out.append(answer[:i] + ("0" if c != "0" else "1") + answer[i + 1:])
    out.append(answer[:i] + ("z" if c != "z" else "y") + answer[i + 1:])
    return [o for o in out if o != answer]


@pytest.mark.parametrize("task", [t for t in T.TASK_NAMES if t != "shuffle"])
def test_scorer_rejects_corrupted(task):
    rng = np.random.default_rng(0)
    for prompt, answer in T.eval_instances(task, 100):
        for bad in _corruptions(answer, rng):
            assert not T.score(task, prompt, bad), (prompt, answer, bad)


def test_list_tasks_semantics():
    xs = ["bob", "eve", "tom", "ann"]
    lst = ",".join(xs)
    assert T.score("copy", f"copy: {lst}", lst)
    assert T.score("reverse", f"reverse: {lst}", "ann,tom,eve,bob")
    assert not T.score("reverse", f"reverse: {lst}", lst)
    assert T.score("sort", f"sort: {lst}", "ann,bob,eve,tom")
    assert T.score("insert", f"insert sue at 0: {lst}", "sue,bob,eve,tom,ann")
    assert T.score("insert", f"insert sue at 4: {lst}", "bob,eve,tom,ann,sue")
    assert T.score("remove", f"remove 3: {lst}", "bob,eve,tom")
    assert T.score("replace", f"replace 1 with sue: {lst}", "bob,sue,tom,ann")
    assert T.score("add", "add: 999+001", "1000")
    assert not T.score("add", "add: 999+001", "999")
    assert T.score("word", "ann has 27, gets 35, gives 14. how many now?", "27+35=062;062-14=048")
    assert not T.score("word", "ann has 27, gets 35, gives 14. how many now?", "27+35=062;062-14=049")


def test_shuffle_accepts_any_permutation_only():
    for prompt, answer in T.eval_instances("shuffle", 30):
        xs = prompt.split(": ", 1)[1].split(",")
        for perm in itertools.permutations(xs):
            assert T.score("shuffle", prompt, ",".join(perm))
        assert T.score("shuffle", prompt, answer)
        bad = [
            ",".join(xs[:-1]),  # one missing
            ",".join(xs + [xs[0]]),  # one duplicated extra
            ",".join([xs[0]] + xs[:-1]) if xs[0] != xs[-1] else "x",  # duplicate replaces one
            ",".join([n for n in T.NAMES if n not in xs][:1] + xs[1:]),  # a foreign name
            " ".join(xs),  # wrong separator
            ", ".join(xs),
            "",
        ]
        for b in bad:
            assert not T.score("shuffle", prompt, b), (prompt, b)


def test_instances_fit_the_layout():
    """Every instance fits a 48-token generation and a 72-token chat prompt (bench/train_tiny.py)."""
    from polestar_jax.io.tokenizer import bundled_model_dir, load_tokenizer

    tok = load_tokenizer(bundled_model_dir())
    for task in T.TASK_NAMES:
        for prompt, answer in T.eval_instances(task, 50):
            assert len(tok.encode(answer)) <= 40
            assert len(tok.chat_prompt_ids(prompt)) <= 72


def test_train_eval_seeds_disjoint():
    T.check_seed_ranges()
    assert T.TRAIN_SEED_LIMIT <= T.EVAL_SEED_BASE
    with pytest.raises(ValueError):
        T.train_rng(T.TRAIN_SEED_LIMIT)
    with pytest.raises(ValueError):
        T.train_rng(-1)
    T.train_rng(T.TRAIN_SEED_LIMIT - 1)


def test_training_stream_skips_held_out_prompts():
    rng = T.train_rng(0)
    for _ in range(300):
        task, prompt, answer = T.sample_task(rng)
        assert prompt not in T.holdout_prompts(task)
        assert T.score(task, prompt, answer)
    # held-out prompts are evaluation prompts
    assert T.eval_instances("add", 3)[2][0] in T.holdout_prompts("add")


def test_decode_answer_cuts_at_eos():
    from polestar_jax.io.tokenizer import bundled_model_dir, load_tokenizer

    tok = load_tokenizer(bundled_model_dir())
    eos = tok.eos_token_id
    ids = tok.encode("bob,eve") + [eos, eos] + tok.encode("junk") + [eos]
    assert T.decode_answer(tok, ids) == "bob,eve"
    assert T.decode_answer(tok, tok.encode("ann")) == "ann"
    assert T.decode_answer(tok, [eos] * 4) == ""
