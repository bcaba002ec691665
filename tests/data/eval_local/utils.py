"""Dataset and scorer of the local ``polestar_local`` task: ``polestar_local.jsonl`` beside this file (rows
``{"task", "prompt", "answer"}``: held-out ``bench.tasks`` instances, written by ``tests/test_eval.py``'s
``local_items``), scored with ``bench.tasks.score`` exactly as ``bench.run`` scores them."""
from __future__ import annotations

import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
if _REPO not in sys.path:  # bench/ lives at the repository root
    sys.path.insert(0, _REPO)

DATA = os.path.join(_HERE, "polestar_local.jsonl")


def load_docs(**_metadata):
    import datasets

    with open(DATA, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def process_results(doc, results):
    from bench import tasks as T

    return {"exact_match": float(T.score(doc["task"], doc["prompt"], results[0]))}
