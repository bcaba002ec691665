"""The long-answer tasks of bench/tasks/long.py (issue #13): references against independent recomputation,
answer lengths, disjoint train/eval seeds, exact scorers, and the tiny_long preset of bench/train_tiny.py."""
from __future__ import annotations

import numpy as np
import pytest

from bench import tasks as T
from bench.tasks import long as TL

N = 200


def _items(prompt: str) -> list[str]:
    return prompt.split(": ", 1)[1].split(",")


def _expected(task: str, prompt: str) -> str:
    """The answer recomputed from the prompt text alone, without the module's helpers."""
    head, body = prompt.split(": ", 1)
    xs = body.split(",")
    words = head.split(" ")
    if task == "long_copy":
        out = list(xs)
    elif task == "long_reverse":
        out = [xs[len(xs) - 1 - i] for i in range(len(xs))]
    elif task == "long_sort":
        out = sorted(xs, key=lambda s: [ord(c) for c in s])
    elif task == "long_insert":  # insert NAME at I
        name, i = words[1], int(words[3])
        out = xs[:i] + [name] + xs[i:]
    elif task == "long_remove":  # remove I
        i = int(words[1])
        out = [x for j, x in enumerate(xs) if j != i]
    elif task == "long_replace":  # replace I with NAME
        i, name = int(words[1]), words[3]
        out = [name if j == i else x for j, x in enumerate(xs)]
    elif task == "long_rotate":  # rotate K: element j of the answer is element (j + k) mod n of the input
        k, n = int(words[1]), len(xs)
        out = [xs[(j + k) % n] for j in range(n)]
    elif task == "long_swap":
        out = [xs[j ^ 1] if (j ^ 1) < len(xs) else xs[j] for j in range(len(xs))]
    elif task == "long_runmax":
        out, cur = [], 0
        for c in xs:
            d = int(c)
            cur = 0 if d == 0 else (d if d > cur else cur)
            out.append(str(cur))
    else:
        raise AssertionError(task)
    return ",".join(out)


def test_group_is_separate():
    assert set(T.LONG_TASK_NAMES) == set(TL.LONG_TASKS) and len(T.LONG_TASK_NAMES) >= 8
    assert not set(T.LONG_TASK_NAMES) & set(T.TASK_NAMES)
    assert T.TASK_NAMES == ("copy", "reverse", "sort", "insert", "remove", "replace", "shuffle", "add", "word")
    assert all(n in T.TASKS for n in T.LONG_TASK_NAMES)


def test_short_tasks_unchanged():
    # instances of the tiny_tasks group do not depend on the long tasks being registered (salts 0..8)
    assert T.instance("copy", 0) == T.TASKS["copy"].make(np.random.default_rng([0, 0]))
    assert T.instance("word", 5) == T.TASKS["word"].make(np.random.default_rng([5, 8]))


@pytest.mark.parametrize("task", T.LONG_TASK_NAMES)
def test_reference_matches_recomputation(task):
    for prompt, answer in T.eval_instances(task, N) + [T.instance(task, s) for s in range(50)]:
        assert answer == _expected(task, prompt), (prompt, answer)
        assert T.score(task, prompt, answer)
        assert T.score(task, prompt, f" {answer}\n")
        assert prompt.isascii() and answer.isascii()
        assert len(answer) <= T.MAX_LONG_ANSWER_CHARS


@pytest.mark.parametrize("task", T.LONG_TASK_NAMES)
def test_instances_well_formed(task):
    for prompt, _ in T.eval_instances(task, N):
        xs = _items(prompt)
        if task == "long_runmax":
            assert TL.RUNMAX_MIN_LEN <= len(xs) <= TL.RUNMAX_MAX_LEN and all(x in "0123456789" for x in xs)
        else:
            assert TL.LONG_MIN_LEN <= len(xs) <= TL.LONG_MAX_LEN
            assert len(set(xs)) == len(xs) and set(xs) <= set(TL.LONG_NAMES)
            words = prompt.split(": ", 1)[0].split(" ")
            if task in ("long_insert", "long_replace"):
                new = words[1] if task == "long_insert" else words[3]
                assert new in TL.LONG_NAMES and new not in xs
            if task == "long_insert":
                assert 0 <= int(words[3]) <= len(xs)
            if task in ("long_remove", "long_replace"):
                assert 0 <= int(words[1]) < len(xs)
            if task == "long_rotate":
                assert 1 <= int(words[1]) < len(xs)


def test_answer_lengths():
    means = {}
    for task in T.LONG_TASK_NAMES:
        lens = [len(a) for _, a in T.eval_instances(task, N)]
        means[task] = float(np.mean(lens))
        assert means[task] >= 64, (task, means[task])
    assert float(np.mean(list(means.values()))) >= 70, means


def test_names_and_sorting_by_first_letter():
    assert len(TL.LONG_NAMES) == 26 == len({n[0] for n in TL.LONG_NAMES})
    assert set(T.NAMES) <= set(TL.LONG_NAMES) and all(len(n) == 3 and n.isalpha() for n in TL.LONG_NAMES)


def test_generator_deterministic_and_varied():
    for task in T.LONG_TASK_NAMES:
        a = [T.instance(task, s) for s in range(20)]
        assert a == [T.instance(task, s) for s in range(20)]
        assert len(set(a)) == 20
        assert T.eval_instances(task, 5, start=3) == [T.instance(task, T.EVAL_SEED_BASE + 3 + i) for i in range(5)]


def test_train_eval_disjoint():
    T.check_seed_ranges()
    with pytest.raises(ValueError):
        T.train_rng(T.EVAL_SEED_BASE)
    rng = T.train_rng(0)
    held = {task: T.holdout_prompts(task) for task in T.LONG_TASK_NAMES}
    assert all(len(h) == T.HOLDOUT_PER_TASK for h in held.values())  # long instances never collide
    seen = set()
    for _ in range(600):
        task, prompt, answer = T.sample_task(rng, T.LONG_TASK_NAMES)
        assert task in T.LONG_TASK_NAMES and prompt not in held[task]
        assert T.score(task, prompt, answer)
        seen.add(task)
    assert seen == set(T.LONG_TASK_NAMES)
    # training draws from seeds < TRAIN_SEED_LIMIT only produce prompts outside the evaluation set here too
    for task in T.LONG_TASK_NAMES:
        train = {T.instance(task, s)[0] for s in range(300)}
        assert not train & held[task]


def _corruptions(answer: str, rng: np.random.Generator) -> list[str]:
    xs = answer.split(",")
    out = ["", answer[:-1], answer + "x", answer + ",ann", answer + ",0", answer[1:], ",".join(xs[:-1]),
           ",".join(xs[1:] + xs[:1]), ",".join(xs[::-1]), answer.replace(",", " "), answer.replace(",", ", ")]
    i = int(rng.integers(len(answer)))
    c = answer[i]
    out.append(answer[:i] + ("0" if c != "0" else "1") + answer[i + 1:])
    out.append(answer[:i] + ("z" if c != "z" else "y") + answer[i + 1:])
    j, k = sorted(rng.choice(len(xs), 2, replace=False))
    ys = list(xs)
    ys[j], ys[k] = ys[k], ys[j]
    out.append(",".join(ys))
    return [o for o in out if o != answer]


@pytest.mark.parametrize("task", T.LONG_TASK_NAMES)
def test_scorer_rejects_wrong(task):
    rng = np.random.default_rng(1)
    for prompt, answer in T.eval_instances(task, 100):
        for bad in _corruptions(answer, rng):
            assert not T.score(task, prompt, bad), (prompt, answer, bad)
    # malformed prompts score False instead of raising
    assert not T.score(task, "nonsense", "x")


def test_semantics_examples():
    names = "ann,bob,cal,dan,eve"
    assert T.score("long_rotate", f"rotate 2: {names}", "cal,dan,eve,ann,bob")
    assert T.score("long_swap", f"swap pairs: {names}", "bob,ann,dan,cal,eve")
    assert T.score("long_swap", "swap pairs: ann,bob,cal,dan", "bob,ann,dan,cal")
    assert T.score("long_runmax", "runmax: 3,1,4,1,5,0,2,9,1", "3,3,4,4,5,0,2,9,9")
    assert not T.score("long_runmax", "runmax: 3,1,4,1,5,0,2,9,1", "3,3,4,4,5,5,5,9,9")
    assert T.score("long_insert", f"insert zed at 5: {names}", names + ",zed")
    assert T.score("long_replace", f"replace 0 with xia: {names}", "xia" + names[3:])


def test_tiny_long_preset_fits():
    from bench import train_tiny as TT
    from polestar_jax.io.tokenizer import asset_model_dir, load_tokenizer

    tc = TT.preset_config("tiny_long")
    assert tc.preset == "tiny_long" and set(T.LONG_TASK_NAMES) <= set(tc.tasks)
    assert tc.eval_tasks == T.LONG_TASK_NAMES  # evaluated on the long tasks only
    assert len(tc.task_weights) == len(tc.tasks) and tc.init_from == "tiny_tasks"
    assert tc.gen_length >= 128 and tc.gen_length % 32 == 0 and tc.block_length == 32
    assert tc.gen_length // tc.block_length >= 4
    assert T.MAX_LONG_ANSWER_CHARS < tc.gen_length  # room for at least one EOS
    assert -(-tc.prompt_slot // 16) * 16 + tc.gen_length <= tc.max_sequence_length
    # the longest possible prompt (replace at a 2-digit index with a full list) fits the prompt slot
    tok = load_tokenizer(asset_model_dir(TT.TOKENIZER_SOURCE))
    longest = "replace 23 with zed: " + ",".join(TL.LONG_NAMES[:TL.LONG_MAX_LEN])
    assert len(TT.prompt_ids(tok, longest)) <= tc.prompt_slot
    for task in tc.tasks:  # every training task (curriculum included) fits the layout
        for p, a in T.eval_instances(task, 50):
            assert len(TT.prompt_ids(tok, p)) <= tc.prompt_slot and len(a) < tc.gen_length
    # the default is still tiny_tasks, and configurations saved without a preset read back as tiny_tasks
    assert TT.preset_config("tiny_tasks") == TT.TrainConfig()
    d = TT.TrainConfig().to_json()
    del d["preset"]
    assert TT.TrainConfig.from_json(d) == TT.TrainConfig()
    assert TT.TrainConfig.from_json(tc.to_json()) == tc
    batch, rows = TT.make_batch(T.train_rng(0), dataclasses_replace(tc, batch=4), tok)
    assert batch["ids"].shape == (4, tc.prompt_slot + tc.gen_length)
    assert all(T.score(t, p, a) for t, p, a in rows)


def dataclasses_replace(tc, **kw):
    import dataclasses

    return dataclasses.replace(tc, **kw)


@pytest.mark.parametrize("task", T.LONG_TASK_NAMES)
def test_mid_curriculum_is_the_same_task_on_medium_lists(task):
    """``mid_*``: the formats and references of the long tasks on 7-14 names (16-31 digits), registered
    with their own seeds; the long tasks' instances do not change."""
    mid = "mid_" + task[len("long_"):]
    assert mid in T.MID_TASK_NAMES and mid not in T.LONG_TASK_NAMES and mid not in T.TASK_NAMES
    lo, hi = TL.MID_RUNMAX_LEN if task == "long_runmax" else TL.MID_LEN
    lengths = set()
    for p, a in T.eval_instances(mid, 60):
        n = len(_items(p))
        assert lo <= n <= hi
        lengths.add(n)
        assert a == _expected(task, p) and T.score(mid, p, a)
    assert len(lengths) >= 4
    long_prompts = {p for p, _ in T.eval_instances(task, 60)}
    assert not long_prompts & {p for p, _ in T.eval_instances(mid, 60)}
    assert all(TL.LONG_MIN_LEN <= len(_items(p)) for p in long_prompts) or task == "long_runmax"


def test_bundled_tiny_long_keeps_predicting_after_a_revealed_prefix():
    """The bundled ``tiny_long`` (run 6; runs 4-6 train half of the rows block-structured) still predicts
    the rest of a ``long_copy`` answer once its first blocks are filled in correctly, the state a block
    decoder meets. Run 3 (independent masks only) was right on 99.6% from the all-masked answer but on 35%
    of the rest after 32 revealed tokens."""
    from bench.probe_prefix import probe
    from bench.train_tiny import asset_model_dir

    acc = probe(asset_model_dir("tiny_long"), "long_copy", n=2, prefixes=(0, 32, 64), rates=(0.5,))
    assert set(acc) == {"all-masked", "prefix 0", "prefix 32", "prefix 64", "iid 0.5"}
    assert all(acc[k] >= 0.95 for k in acc), acc
