"""Synthetic tasks with exact scorers for the tiny trained LLaDA (issue #6).

In the spirit of ParallelBench's "waiting line" tasks: list manipulations on short lists of fixed-length
names, plus small arithmetic. Every task is a :class:`Task` with

* ``make(rng) -> (prompt, answer)``: a seeded generator (``rng`` is a ``numpy.random.Generator``);
* ``score(prompt, output) -> bool``: an exact scorer (``output`` is the decoded answer text, already cut at
  the first end-of-text token, see :func:`decode_answer`; surrounding whitespace is ignored).

Formats (names are 3 lowercase letters from :data:`NAMES`, lists hold 3-6 distinct names, comma-separated
without spaces; indices are 0-based)::

    copy      "copy: bob,eve,tom"                 -> "bob,eve,tom"
    reverse   "reverse: bob,eve,tom"              -> "tom,eve,bob"
    sort      "sort: tom,bob,eve"                 -> "bob,eve,tom"
    insert    "insert sue at 1: bob,eve,tom"      -> "bob,sue,eve,tom"   (index 0..n, name not in the list)
    remove    "remove 1: bob,eve,tom"             -> "bob,tom"           (index 0..n-1)
    replace   "replace 2 with sue: bob,eve,tom"   -> "bob,eve,sue"       (index 0..n-1, name not in the list)
    shuffle   "shuffle: bob,eve,tom"              -> a random permutation, e.g. "eve,tom,bob";
                                                     ANY permutation of the input list scores as correct
    add       "add: 347+085"                      -> "0432"  (operands 0..999 zero-padded to 3 digits,
                                                               sum zero-padded to 4 digits)
    word      "ann has 27, gets 35, gives 14. how many now?"
                                                  -> "27+35=062;062-14=048"  (two steps; inputs 10..99,
                                                     the give-away is below the sum; results 3 digits)

Seeds: training draws instances from ``numpy.random.default_rng(seed)`` with ``seed < TRAIN_SEED_LIMIT``
(:func:`train_rng`); evaluation instance ``i`` of a task comes from seed ``EVAL_SEED_BASE + i``
(:func:`eval_instances`). The two ranges are disjoint (asserted). Training additionally skips any instance
whose prompt equals one of the first :data:`HOLDOUT_PER_TASK` evaluation prompts of its task
(:func:`holdout_prompts`), so evaluation on those is on unseen prompts.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional, Sequence

import numpy as np

__all__ = [
    "NAMES", "Task", "TASKS", "TASK_NAMES", "TRAIN_SEED_LIMIT", "EVAL_SEED_BASE", "HOLDOUT_PER_TASK",
    "MAX_ANSWER_CHARS", "instance", "eval_instances", "train_rng", "holdout_prompts", "sample_task",
    "decode_answer", "score", "check_seed_ranges",
]

#: 20 names of 3 letters with distinct first letters (sorting only needs the first letter).
NAMES: tuple[str, ...] = ("ann", "bob", "cal", "dan", "eve", "fay", "gus", "hal", "ivy", "jan",
                          "kat", "leo", "max", "ned", "oli", "pat", "rex", "sue", "tom", "val")
_NAME_SET = frozenset(NAMES)
MIN_LEN, MAX_LEN = 3, 6

TRAIN_SEED_LIMIT = 10**6  # training seeds are in [0, TRAIN_SEED_LIMIT)
EVAL_SEED_BASE = 10**9  # evaluation seeds are >= EVAL_SEED_BASE
HOLDOUT_PER_TASK = 1000  # evaluation instances per task excluded from training
MAX_ANSWER_CHARS = 4 * (MAX_LEN + 1) - 1  # longest answer: insert into a list of MAX_LEN names (27 chars)


def check_seed_ranges() -> None:
    """Asserts that the training and evaluation seed ranges are disjoint."""
    assert 0 < TRAIN_SEED_LIMIT <= EVAL_SEED_BASE, (TRAIN_SEED_LIMIT, EVAL_SEED_BASE)


check_seed_ranges()


@dataclasses.dataclass(frozen=True)
class Task:
    """A task: a generator ``make(rng) -> (prompt, answer)`` and an exact ``score(prompt, output)``."""

    name: str
    make: Callable[[np.random.Generator], tuple[str, str]]
    score: Callable[[str, str], bool]
    doc: str = ""


# ------------------------------------------------------------------------------------------ helpers

def _names(rng: np.random.Generator, n: Optional[int] = None) -> list[str]:
    if n is None:
        n = int(rng.integers(MIN_LEN, MAX_LEN + 1))
    return [NAMES[i] for i in rng.choice(len(NAMES), size=n, replace=False)]


def _fresh_name(rng: np.random.Generator, used: Sequence[str]) -> str:
    pool = [x for x in NAMES if x not in used]
    return pool[int(rng.integers(len(pool)))]


def _join(xs: Sequence[str]) -> str:
    return ",".join(xs)


def _list_of(prompt: str) -> list[str]:
    """The input list of a list-task prompt (the text after the last ': ')."""
    return prompt.rsplit(": ", 1)[1].split(",")


def _exact(reference: Callable[[str], str]) -> Callable[[str, str], bool]:
    def score(prompt: str, output: str) -> bool:
        return output.strip() == reference(prompt)
    return score


# ------------------------------------------------------------------------------------ list tasks

def _make_copy(rng):
    xs = _names(rng)
    return f"copy: {_join(xs)}", _join(xs)


def _ref_copy(prompt):
    return _join(_list_of(prompt))


def _make_reverse(rng):
    xs = _names(rng)
    return f"reverse: {_join(xs)}", _join(xs[::-1])


def _ref_reverse(prompt):
    return _join(_list_of(prompt)[::-1])


def _make_sort(rng):
    xs = _names(rng)
    return f"sort: {_join(xs)}", _join(sorted(xs))


def _ref_sort(prompt):
    return _join(sorted(_list_of(prompt)))


_INSERT_RE = re.compile(r"^insert ([a-z]{3}) at (\d+): ")


def _make_insert(rng):
    xs = _names(rng)
    new = _fresh_name(rng, xs)
    i = int(rng.integers(0, len(xs) + 1))
    return f"insert {new} at {i}: {_join(xs)}", _join(xs[:i] + [new] + xs[i:])


def _ref_insert(prompt):
    m = _INSERT_RE.match(prompt)
    xs, new, i = _list_of(prompt), m.group(1), int(m.group(2))
    return _join(xs[:i] + [new] + xs[i:])


_REMOVE_RE = re.compile(r"^remove (\d+): ")


def _make_remove(rng):
    xs = _names(rng)
    i = int(rng.integers(0, len(xs)))
    return f"remove {i}: {_join(xs)}", _join(xs[:i] + xs[i + 1:])


def _ref_remove(prompt):
    xs, i = _list_of(prompt), int(_REMOVE_RE.match(prompt).group(1))
    return _join(xs[:i] + xs[i + 1:])


_REPLACE_RE = re.compile(r"^replace (\d+) with ([a-z]{3}): ")


def _make_replace(rng):
    xs = _names(rng)
    new = _fresh_name(rng, xs)
    i = int(rng.integers(0, len(xs)))
    return f"replace {i} with {new}: {_join(xs)}", _join(xs[:i] + [new] + xs[i + 1:])


def _ref_replace(prompt):
    m = _REPLACE_RE.match(prompt)
    xs, i, new = _list_of(prompt), int(m.group(1)), m.group(2)
    return _join(xs[:i] + [new] + xs[i + 1:])


def _make_shuffle(rng):
    xs = _names(rng)
    perm = rng.permutation(len(xs))
    return f"shuffle: {_join(xs)}", _join([xs[int(j)] for j in perm])


def _score_shuffle(prompt: str, output: str) -> bool:
    """Correct iff the output is a comma-separated permutation of the input list (same names, same
    multiplicity, no extra whitespace inside)."""
    out = output.strip().split(",")
    return sorted(out) == sorted(_list_of(prompt))


# ------------------------------------------------------------------------------------ arithmetic

_ADD_RE = re.compile(r"^add: (\d{3})\+(\d{3})$")


def _make_add(rng):
    a, b = (int(v) for v in rng.integers(0, 1000, size=2))
    return f"add: {a:03d}+{b:03d}", f"{a + b:04d}"


def _ref_add(prompt):
    m = _ADD_RE.match(prompt)
    return f"{int(m.group(1)) + int(m.group(2)):04d}"


_WORD_RE = re.compile(r"^([a-z]{3}) has (\d+), gets (\d+), gives (\d+)\. how many now\?$")


def _make_word(rng):
    name = NAMES[int(rng.integers(len(NAMES)))]
    a, b = (int(v) for v in rng.integers(10, 100, size=2))
    c = int(rng.integers(10, min(99, a + b - 1) + 1))  # 10..99 and below a + b: the result is positive
    s = a + b
    return (f"{name} has {a}, gets {b}, gives {c}. how many now?", f"{a}+{b}={s:03d};{s:03d}-{c}={s - c:03d}")


def _ref_word(prompt):
    m = _WORD_RE.match(prompt)
    a, b, c = int(m.group(2)), int(m.group(3)), int(m.group(4))
    s = a + b
    return f"{a}+{b}={s:03d};{s:03d}-{c}={s - c:03d}"


# ------------------------------------------------------------------------------------ registry

TASKS: dict[str, Task] = {t.name: t for t in (
    Task("copy", _make_copy, _exact(_ref_copy), "repeat the list"),
    Task("reverse", _make_reverse, _exact(_ref_reverse), "the list in reverse order"),
    Task("sort", _make_sort, _exact(_ref_sort), "the list sorted alphabetically"),
    Task("insert", _make_insert, _exact(_ref_insert), "insert a name at a 0-based index"),
    Task("remove", _make_remove, _exact(_ref_remove), "remove the name at a 0-based index"),
    Task("replace", _make_replace, _exact(_ref_replace), "replace the name at a 0-based index"),
    Task("shuffle", _make_shuffle, _score_shuffle, "any permutation of the list"),
    Task("add", _make_add, _exact(_ref_add), "3-digit addition, zero-padded"),
    Task("word", _make_word, _exact(_ref_word), "two-step word problem (add, then subtract)"),
)}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
_TASK_SALT = {name: i for i, name in enumerate(TASK_NAMES)}


def instance(task: str, seed: int) -> tuple[str, str]:
    """The (prompt, answer) of ``task`` for ``seed`` (deterministic)."""
    return TASKS[task].make(np.random.default_rng([int(seed), _TASK_SALT[task]]))


def eval_instances(task: str, n: int, start: int = 0) -> list[tuple[str, str]]:
    """Evaluation instances ``start .. start+n-1`` of ``task`` (seeds ``EVAL_SEED_BASE + i``)."""
    return [instance(task, EVAL_SEED_BASE + i) for i in range(start, start + n)]


_HOLDOUT: dict[str, frozenset] = {}


def holdout_prompts(task: str) -> frozenset:
    """Prompts of the first :data:`HOLDOUT_PER_TASK` evaluation instances of ``task`` (never trained on)."""
    if task not in _HOLDOUT:
        _HOLDOUT[task] = frozenset(p for p, _ in eval_instances(task, HOLDOUT_PER_TASK))
    return _HOLDOUT[task]


def train_rng(seed: int) -> np.random.Generator:
    """The training data stream of ``seed`` (must be in ``[0, TRAIN_SEED_LIMIT)``)."""
    if not 0 <= int(seed) < TRAIN_SEED_LIMIT:
        raise ValueError(f"training seed {seed} outside [0, {TRAIN_SEED_LIMIT})")
    rng = np.random.default_rng(int(seed))
    return rng


def sample_task(rng: np.random.Generator, tasks: Sequence[str] = TASK_NAMES,
                weights: Optional[Sequence[float]] = None) -> tuple[str, str, str]:
    """One training instance ``(task, prompt, answer)``: a task drawn with ``weights`` (uniform by
    default), then an instance of it whose prompt is not held out for evaluation."""
    p = None if weights is None else np.asarray(weights, np.float64) / np.sum(weights)
    task = tasks[int(rng.choice(len(tasks), p=p))]
    held = holdout_prompts(task)
    while True:
        prompt, answer = TASKS[task].make(rng)
        if prompt not in held:
            return task, prompt, answer


def score(task: str, prompt: str, output: str) -> bool:
    """Exact score of ``output`` for ``prompt`` of ``task``; malformed output scores False."""
    try:
        return bool(TASKS[task].score(prompt, output))
    except (ValueError, AttributeError, IndexError):
        return False


def decode_answer(tokenizer, ids: Sequence[int]) -> str:
    """Answer text of generated ids: cut at the first EOS (or ``<|eot_id|>``), special tokens dropped."""
    stops = {tokenizer.eos_token_id, tokenizer.token_to_id("<|eot_id|>")} - {None}
    out = []
    for t in ids:
        if int(t) in stops:
            break
        out.append(int(t))
    return tokenizer.decode(out, skip_special_tokens=True)


# ------------------------------------------------------------------------------------ long-answer tasks
# The ``tiny_long`` group (issue #13, :mod:`bench.tasks.long`): registered in TASKS (so instance, eval_instances,
# sample_task, holdout_prompts and score work on them) but not in TASK_NAMES, which stays the tiny_tasks group.
# Their salts start at 100, so adding them changes no existing task's instances.

# The ``mid_*`` tasks (the same formats on 7-14 names) are ``tiny_long``'s training curriculum; salts from 200.

from .long import LONG_NAMES, LONG_TASKS, MAX_LONG_ANSWER_CHARS, MID_TASKS  # noqa: E402

LONG_TASK_NAMES: tuple[str, ...] = tuple(LONG_TASKS)
MID_TASK_NAMES: tuple[str, ...] = tuple(MID_TASKS)
TASKS.update(LONG_TASKS)
TASKS.update(MID_TASKS)
_TASK_SALT.update({name: 100 + i for i, name in enumerate(LONG_TASK_NAMES)})
_TASK_SALT.update({name: 200 + i for i, name in enumerate(MID_TASK_NAMES)})
__all__ += ["LONG_NAMES", "LONG_TASKS", "LONG_TASK_NAMES", "MID_TASKS", "MID_TASK_NAMES", "MAX_LONG_ANSWER_CHARS"]
