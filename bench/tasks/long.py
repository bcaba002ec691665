"""Long-answer tasks (issue #13): the list tasks of :mod:`bench.tasks` on long lists, plus tasks whose answer
tokens depend on each other, for the ``tiny_long`` model (generation length 128, block length 32).

Registered in :data:`bench.tasks.TASKS` under the names of :data:`bench.tasks.LONG_TASK_NAMES` (all
prefixed ``long_``), so :func:`bench.tasks.instance`, :func:`~bench.tasks.eval_instances`,
:func:`~bench.tasks.sample_task`, :func:`~bench.tasks.holdout_prompts` and :func:`~bench.tasks.score` work on
them with the same disjoint training / evaluation seed ranges; :data:`bench.tasks.TASK_NAMES` (the
``tiny_tasks`` group) does not include them.

Names are the 26 three-letter names of :data:`LONG_NAMES` (distinct first letters a..z, so sorting only needs
the first letter); a list holds ``LONG_MIN_LEN..LONG_MAX_LEN`` (15..24) distinct names, comma-separated
without spaces; indices are 0-based. Formats::

    long_copy     "copy: n1,...,nk"                  -> "n1,...,nk"
    long_reverse  "reverse: n1,...,nk"               -> "nk,...,n1"
    long_sort     "sort: ..."                        -> the names sorted alphabetically
    long_insert   "insert sue at 7: ..."             -> the name inserted at index 7 (index 0..k, name not
                                                        in the list)
    long_remove   "remove 7: ..."                    -> the list without the name at index 7 (0..k-1)
    long_replace  "replace 7 with sue: ..."          -> the name at index 7 replaced (name not in the list)
    long_rotate   "rotate 5: n1,...,nk"              -> "n6,...,nk,n1,...,n5" (rotate left by 1..k-1)
    long_swap     "swap pairs: n1,n2,n3,n4,n5"       -> "n2,n1,n4,n3,n5" (adjacent pairs swapped; with an odd
                                                        length the last name stays)
    long_runmax   "runmax: 3,1,4,1,5,0,2,9,1"        -> "3,3,4,4,5,0,2,9,9" (running maximum of 32..44
                                                        digits that restarts at every 0: output i is 0 where
                                                        input i is 0, else max(output i-1, input i); every
                                                        output digit depends on the previous one)

Answers are 55..99 characters (one byte-level token each), about 76 on average (see the tests).
"""
from __future__ import annotations

import functools
import re
from typing import Sequence

import numpy as np

from . import Task, _exact, _join, _list_of
from . import _ref_copy, _ref_insert, _ref_remove, _ref_replace, _ref_reverse, _ref_sort  # same references

__all__ = ["LONG_NAMES", "LONG_TASKS", "MID_TASKS", "MID_LEN", "MID_RUNMAX_LEN", "LONG_MIN_LEN", "LONG_MAX_LEN", "RUNMAX_MIN_LEN", "RUNMAX_MAX_LEN",
           "MAX_LONG_ANSWER_CHARS"]

#: 26 names of 3 letters with distinct first letters a..z (the 20 of ``bench.tasks.NAMES`` plus 6).
LONG_NAMES: tuple[str, ...] = ("ann", "bob", "cal", "dan", "eve", "fay", "gus", "hal", "ivy", "jan", "kat",
                               "leo", "max", "ned", "oli", "pat", "qin", "rex", "sue", "tom", "uma", "val",
                               "wes", "xia", "yul", "zed")
LONG_MIN_LEN, LONG_MAX_LEN = 15, 24
RUNMAX_MIN_LEN, RUNMAX_MAX_LEN = 32, 44
#: longest answer: insert into a list of LONG_MAX_LEN names (99 characters)
MAX_LONG_ANSWER_CHARS = max(4 * (LONG_MAX_LEN + 1) - 1, 2 * RUNMAX_MAX_LEN - 1)


def _names(rng: np.random.Generator, n_range: tuple[int, int] = (LONG_MIN_LEN, LONG_MAX_LEN)) -> list[str]:
    n = int(rng.integers(n_range[0], n_range[1] + 1))
    return [LONG_NAMES[i] for i in rng.choice(len(LONG_NAMES), size=n, replace=False)]


def _fresh_name(rng: np.random.Generator, used: Sequence[str]) -> str:
    pool = [x for x in LONG_NAMES if x not in used]
    return pool[int(rng.integers(len(pool)))]


# ------------------------------------------------------------------------------------ list tasks
# (the makers draw long lists through this module's _names; the references are the short tasks')

def _make_copy(rng, n_range=(LONG_MIN_LEN, LONG_MAX_LEN)):
    xs = _names(rng, n_range)
    return f"copy: {_join(xs)}", _join(xs)


def _make_reverse(rng, n_range=(LONG_MIN_LEN, LONG_MAX_LEN)):
    xs = _names(rng, n_range)
    return f"reverse: {_join(xs)}", _join(xs[::-1])


def _make_sort(rng, n_range=(LONG_MIN_LEN, LONG_MAX_LEN)):
    xs = _names(rng, n_range)
    return f"sort: {_join(xs)}", _join(sorted(xs))


def _make_insert(rng, n_range=(LONG_MIN_LEN, LONG_MAX_LEN)):
    xs = _names(rng, n_range)
    new = _fresh_name(rng, xs)
    i = int(rng.integers(0, len(xs) + 1))
    return f"insert {new} at {i}: {_join(xs)}", _join(xs[:i] + [new] + xs[i:])


def _make_remove(rng, n_range=(LONG_MIN_LEN, LONG_MAX_LEN)):
    xs = _names(rng, n_range)
    i = int(rng.integers(0, len(xs)))
    return f"remove {i}: {_join(xs)}", _join(xs[:i] + xs[i + 1:])


def _make_replace(rng, n_range=(LONG_MIN_LEN, LONG_MAX_LEN)):
    xs = _names(rng, n_range)
    new = _fresh_name(rng, xs)
    i = int(rng.integers(0, len(xs)))
    return f"replace {i} with {new}: {_join(xs)}", _join(xs[:i] + [new] + xs[i + 1:])


_INSERT_RE = re.compile(r"^insert ([a-z]{3}) at (\d+): ")


_REMOVE_RE = re.compile(r"^remove (\d+): ")


_REPLACE_RE = re.compile(r"^replace (\d+) with ([a-z]{3}): ")


_ROTATE_RE = re.compile(r"^rotate (\d+): ")


def _make_rotate(rng, n_range=(LONG_MIN_LEN, LONG_MAX_LEN)):
    xs = _names(rng, n_range)
    k = int(rng.integers(1, len(xs)))
    return f"rotate {k}: {_join(xs)}", _join(xs[k:] + xs[:k])


def _ref_rotate(prompt):
    xs, k = _list_of(prompt), int(_ROTATE_RE.match(prompt).group(1))
    return _join(xs[k:] + xs[:k])


def _swap_pairs(xs: Sequence[str]) -> list[str]:
    out = list(xs)
    for i in range(0, len(out) - 1, 2):
        out[i], out[i + 1] = out[i + 1], out[i]
    return out


def _make_swap(rng, n_range=(LONG_MIN_LEN, LONG_MAX_LEN)):
    xs = _names(rng, n_range)
    return f"swap pairs: {_join(xs)}", _join(_swap_pairs(xs))


def _ref_swap(prompt):
    return _join(_swap_pairs(_list_of(prompt)))


# ------------------------------------------------------------------------------------ running maximum

def _runmax(ds: Sequence[int]) -> list[int]:
    out, m = [], 0
    for d in ds:
        m = 0 if d == 0 else max(m, d)
        out.append(m)
    return out


def _make_runmax(rng, n_range=(RUNMAX_MIN_LEN, RUNMAX_MAX_LEN)):
    n = int(rng.integers(n_range[0], n_range[1] + 1))
    ds = [int(v) for v in rng.integers(0, 10, size=n)]
    return f"runmax: {_join(map(str, ds))}", _join(map(str, _runmax(ds)))


_RUNMAX_RE = re.compile(r"^runmax: (\d(?:,\d)*)$")


def _ref_runmax(prompt):
    ds = [int(c) for c in _RUNMAX_RE.match(prompt).group(1).split(",")]
    return _join(map(str, _runmax(ds)))


# ------------------------------------------------------------------------------------ registry

LONG_TASKS: dict[str, Task] = {t.name: t for t in (
    Task("long_copy", _make_copy, _exact(_ref_copy), "repeat a long list"),
    Task("long_reverse", _make_reverse, _exact(_ref_reverse), "a long list in reverse order"),
    Task("long_sort", _make_sort, _exact(_ref_sort), "a long list sorted alphabetically"),
    Task("long_insert", _make_insert, _exact(_ref_insert), "insert a name at a 0-based index of a long list"),
    Task("long_remove", _make_remove, _exact(_ref_remove), "remove the name at a 0-based index of a long list"),
    Task("long_replace", _make_replace, _exact(_ref_replace),
         "replace the name at a 0-based index of a long list"),
    Task("long_rotate", _make_rotate, _exact(_ref_rotate), "rotate a long list left by k"),
    Task("long_swap", _make_swap, _exact(_ref_swap), "swap adjacent pairs of a long list"),
    Task("long_runmax", _make_runmax, _exact(_ref_runmax), "running maximum of 32-44 digits, restarting at 0"),
)}

#: Curriculum lengths between ``tiny_tasks``' 3-6 names and the long tasks' 15-24: 7..14 names, 16..31 digits.
MID_LEN, MID_RUNMAX_LEN = (7, 14), (16, 31)
#: The same nine formats on medium lists (``mid_*``): a training curriculum for ``tiny_long``, which has to
#: stretch ``tiny_tasks``' copying of short lists to long ones; never part of an evaluation.
MID_TASKS: dict[str, Task] = {
    "mid_" + t.name[len("long_"):]: Task(
        "mid_" + t.name[len("long_"):],
        functools.partial(t.make, n_range=MID_RUNMAX_LEN if t.name == "long_runmax" else MID_LEN),
        t.score, t.doc.replace("a long list", "a medium list").replace("32-44", "16-31"))
    for t in LONG_TASKS.values()}
