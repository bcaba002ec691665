"""Synthetic image tasks with exact answers for the tiny trained LLaDA-V (``tiny_vision``, issue #46 item 5).

A :class:`Scene` is 1-4 copies of one shape (circle, square or triangle) in one colour of :data:`COLOURS`,
drawn by Pillow on a plain light background of ``SIZE x SIZE`` pixels (384: LLaDA-V's crop size, so the
``anyres`` preprocessing neither scales nor pads it). The picture is a ``GRID x GRID`` board of ``CELL``-pixel
cells (96: the tower's patch size, so every object lies inside one patch); each object sits in its own cell,
its size and offset jittered. Every scene answers four questions (:data:`QUESTIONS`)::

    colour    "What colour are the shapes?"    -> "red"
    shape     "What shape are they?"           -> "circle"
    count     "How many shapes are there?"     -> "three"
    describe  "Describe the picture."          -> "three red circles"  ("one red circle" for one)

Seeds: training scenes come from ``numpy.random.default_rng(seed)`` with ``seed < TRAIN_SEED_LIMIT``
(:func:`train_rng`); evaluation instance ``i`` of a task is the scene of seed ``EVAL_SEED_BASE + i``
(:func:`eval_instances`), never drawn in training (the two seed ranges of :mod:`bench.tasks` are disjoint; a
scene is fixed by its seed alone, whatever the task).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

from bench.tasks import EVAL_SEED_BASE, TRAIN_SEED_LIMIT

__all__ = ["SIZE", "CELL", "GRID", "COLOURS", "SHAPES", "COUNTS", "QUESTIONS", "TASK_NAMES", "Scene", "Instance",
           "scene", "draw", "answer", "instance", "eval_instances", "train_rng", "sample", "score", "main",
           "MAX_ANSWER_CHARS"]

SIZE = 384  # picture side in pixels
CELL = 96  # cell side in pixels (the tower's patch)
GRID = SIZE // CELL  # cells per side
BACKGROUND = (245, 245, 240)
#: name -> RGB
COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220),
                                            "yellow": (230, 200, 30), "purple": (140, 60, 180)}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COUNTS: tuple[str, ...] = ("one", "two", "three", "four")
#: task -> question
QUESTIONS: dict[str, str] = {"colour": "What colour are the shapes?", "shape": "What shape are they?",
                             "count": "How many shapes are there?", "describe": "Describe the picture."}
TASK_NAMES: tuple[str, ...] = tuple(QUESTIONS)
MAX_ANSWER_CHARS = len("three purple triangles")


@dataclasses.dataclass(frozen=True)
class Scene:
    """One picture: ``len(boxes)`` copies of ``shape`` in ``colour``; ``boxes`` are (x0, y0, x1, y1) pixels."""

    shape: str
    colour: str
    boxes: tuple[tuple[int, int, int, int], ...]

    @property
    def count(self) -> int:
        return len(self.boxes)


class Instance(NamedTuple):
    """A question about a scene and its exact answer."""

    task: str
    scene: Scene
    question: str
    answer: str


def scene(rng: np.random.Generator) -> Scene:
    """A random scene: shape, colour and count uniform; the objects in distinct random cells, each 56-80
    pixels wide with its top-left corner jittered inside the cell."""
    shape = SHAPES[rng.integers(len(SHAPES))]
    colour = tuple(COLOURS)[rng.integers(len(COLOURS))]
    n = int(rng.integers(1, len(COUNTS) + 1))
    cells = rng.choice(GRID * GRID, size=n, replace=False)
    boxes = []
    for c in cells:
        side = int(rng.integers(56, 81))
        free = CELL - side - 4
        x0 = (int(c) % GRID) * CELL + 2 + int(rng.integers(0, free + 1))
        y0 = (int(c) // GRID) * CELL + 2 + int(rng.integers(0, free + 1))
        boxes.append((x0, y0, x0 + side - 1, y0 + side - 1))
    return Scene(shape, colour, tuple(boxes))


def draw(sc: Scene):
    """The RGB PIL image (``SIZE x SIZE``) of scene ``sc``."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    d = ImageDraw.Draw(im)
    fill = COLOURS[sc.colour]
    for x0, y0, x1, y1 in sc.boxes:
        if sc.shape == "circle":
            d.ellipse((x0, y0, x1, y1), fill=fill)
        elif sc.shape == "square":
            d.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            d.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return im


def answer(task: str, sc: Scene) -> str:
    """The exact answer of ``task`` about scene ``sc``."""
    if task == "colour":
        return sc.colour
    if task == "shape":
        return sc.shape
    if task == "count":
        return COUNTS[sc.count - 1]
    if task == "describe":
        return f"{COUNTS[sc.count - 1]} {sc.colour} {sc.shape}{'s' if sc.count > 1 else ''}"
    raise ValueError(f"unknown image task {task!r} (choose from {', '.join(TASK_NAMES)})")


def instance(task: str, seed: int) -> Instance:
    """The instance of ``task`` on the scene of ``seed``."""
    sc = scene(np.random.default_rng(seed))
    return Instance(task, sc, QUESTIONS[task], answer(task, sc))


def eval_instances(task: str, n: int, start: int = 0) -> list[Instance]:
    """Held-out instances ``start..start+n-1`` of ``task`` (seeds ``EVAL_SEED_BASE + i``)."""
    return [instance(task, EVAL_SEED_BASE + i) for i in range(start, start + n)]


def train_rng(seed: int) -> np.random.Generator:
    """The training stream of run ``seed`` (its scenes never come from an evaluation seed)."""
    if not 0 <= seed < TRAIN_SEED_LIMIT:
        raise ValueError(f"training seed must lie in [0, {TRAIN_SEED_LIMIT}), got {seed}")
    return np.random.default_rng([seed, 0x5CA1E])


def sample(rng: np.random.Generator, tasks: Sequence[str] = TASK_NAMES) -> Instance:
    """A training instance: a task uniform over ``tasks`` and a fresh scene from ``rng``."""
    task = tasks[rng.integers(len(tasks))]
    sc = scene(rng)
    return Instance(task, sc, QUESTIONS[task], answer(task, sc))


def score(inst: Instance, output: str) -> bool:
    """Exact match of the decoded ``output`` (surrounding whitespace ignored)."""
    return output.strip() == inst.answer


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.tasks.shapes --seed SEED --out FILE``: saves the picture of the scene of ``SEED`` (a PNG)
    and prints each question with its answer, one per line."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.tasks.shapes", description=main.__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, required=True, help=f"scene seed (held-out ones: >= {EVAL_SEED_BASE:,})")
    ap.add_argument("--out", required=True, help="PNG file to write")
    args = ap.parse_args(argv)
    sc = scene(np.random.default_rng(args.seed))
    draw(sc).save(args.out, format="PNG")
    for task, question in QUESTIONS.items():
        print(f"{question} {answer(task, sc)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
