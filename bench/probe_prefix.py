"""Revealed-prefix probe (issue #13): does a trained tiny model still predict an answer once its first tokens
are filled in, as they are after a block decoder's first blocks?

For each of ``--n`` held-out instances of ``--task`` the answer region (the answer + EOS padding to the model's
generation length) is built three ways and the model's argmax is scored against the reference:

* ``all-masked``: every answer position masked; accuracy over all positions;
* ``prefix k``: the first ``k`` positions hold the correct tokens, the rest masked; accuracy over the rest;
* ``iid t``: each position masked with probability ``t`` (independent draws, as in LLaDA's training);
  accuracy over the masked positions.

A model that is right from ``all-masked`` and ``iid`` but degrades as ``k`` grows has learned the task for the
states independent masking shows it, not for the clean-prefix states inference shows it (see
``block_mask_prob`` in :mod:`bench.train_tiny`). Rows are laid out as in training: chat prompt, answer region,
positions from 0. Prints one line per probe (means over the instances).

Usage::

    python -m bench.probe_prefix --model polestar_jax/assets/tiny_long --task long_copy --n 6
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import tasks as T  # noqa: E402
from bench import train_tiny as TT  # noqa: E402
from polestar_jax.models import llada as M  # noqa: E402
from polestar_jax.io.checkpoint import generation_defaults, load_model  # noqa: E402
from polestar_jax.io.tokenizer import load_tokenizer  # noqa: E402

PREFIXES = (0, 8, 16, 24, 32, 48)
RATES = (0.2, 0.5, 0.8, 0.95)


def probe(model_dir: str, task: str, n: int, prefixes: Sequence[int] = PREFIXES, rates: Sequence[float] = RATES,
          seed: int = 0) -> dict[str, float]:
    """Mean accuracies (floats in [0, 1]) ``{"all-masked": .., "prefix k": .., "iid t": ..}`` over the first
    ``n`` evaluation instances of ``task``, one batch-1 forward per probe (one compiled shape per call);
    ``seed`` draws the ``iid`` masks."""
    cfg, params = load_model(model_dir, dtype="float32")
    tok = load_tokenizer(model_dir)
    G = int(generation_defaults(model_dir).get("gen_length", 32))
    items = [(TT.prompt_ids(tok, p), a) for p, a in T.eval_instances(task, n)]
    L = max(len(p) for p, _ in items) + G

    @jax.jit
    def argmax_of(ids, valid):  # [1, L] -> [1, L]
        pos = jnp.arange(L, dtype=jnp.int32)[None]
        h = M.forward(params, ids, cfg, pos, pos, valid).h
        return jnp.argmax(M.lm_head(params, h, cfg), axis=-1)

    rng = np.random.default_rng(seed)
    acc: dict[str, list[float]] = {}
    for pid, answer in items:
        n_p = len(pid)
        ref = TT.answer_ids(tok, answer, G)  # [G]
        valid = np.zeros((1, L), bool)
        valid[0, :n_p + G] = True

        def run(masked):  # [G] bool -> predicted answer region [G]
            ids = np.full((1, L), tok.eos_token_id, np.int32)
            ids[0, :n_p] = pid
            ids[0, n_p:n_p + G] = np.where(masked, cfg.mask_token_id, ref)
            return np.asarray(argmax_of(ids, valid))[0, n_p:n_p + G]

        acc.setdefault("all-masked", []).append(float(np.mean(run(np.ones(G, bool)) == ref)))
        for k in prefixes:
            m = np.arange(G) >= k
            acc.setdefault(f"prefix {k}", []).append(float(np.mean(run(m)[m] == ref[m])))
        for t in rates:
            m = rng.random(G) < t
            if m.any():
                acc.setdefault(f"iid {t:g}", []).append(float(np.mean(run(m)[m] == ref[m])))
    return {k: float(np.mean(v)) for k, v in acc.items()}


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=TT.asset_model_dir("tiny_long"), help="model folder (default: tiny_long)")
    ap.add_argument("--task", default="long_copy", choices=sorted(T.TASKS))
    ap.add_argument("--n", type=int, default=6, help="held-out instances")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n must be >= 1")
    for k, v in probe(args.model, args.task, args.n).items():
        print(f"{args.task} {k}: {100 * v:.1f}% right")


if __name__ == "__main__":
    main()
