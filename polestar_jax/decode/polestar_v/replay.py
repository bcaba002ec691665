"""Builds a :class:`~polestar_jax.decode.polestar_v.select.VReplay` from the decisions file of a LLaDA-V
Polestar case made by the official code (``decisions/<stem>.json.gz``; README of the golden folder).

Its ``kmeans`` records (one per pass: ``after_pass``, window length ``L``, ``k``, ``trivial``, ``init_idx``
= the ``randperm`` prefix used as initial centroids, ``reseed_draws`` = one ``randint`` vector per iteration
with an empty cluster, ``labels`` = the final labels as a digit string in window order) and its
``refresh_topk`` records (``before_pass``, ``clusters``) become the replay's arrays, indexed by the pass
that built the state (a selection made before pass ``p`` reads the state of pass ``p - 1``).
"""
from __future__ import annotations

import numpy as np

from polestar_jax.decode.polestar_v.state import VConfig
from polestar_jax.errors import PolestarError


def build_replay(decisions: list, vc: VConfig, window_rows: int, max_forwards: int, force_labels: bool = True,
                 force_topk: bool = True):
    """The replay of one case (batch 1): k-means draws always; the final labels and the selected clusters
    when ``force_labels`` / ``force_topk`` (else this implementation computes them from the draws).
    ``window_rows``: the run's static window (:meth:`VConfig.window_rows` of its prompt slot);
    ``max_forwards``: a bound of the case's NFE."""
    import jax.numpy as jnp

    from polestar_jax.decode.polestar_v.select import VReplay

    k, it, f, w = vc.n_clusters, vc.kmeans_iters, max_forwards, window_rows
    init = np.zeros((1, f, k), np.int32)
    reseed = np.zeros((1, f, it, k), np.int32)
    labels = np.zeros((1, f, w), np.int32)
    forced = np.zeros((1, f), bool)
    topk = np.zeros((1, f, k), bool)
    topk_forced = np.zeros((1, f), bool)
    for d in decisions:
        kind = d.get("kind")
        if kind == "kmeans":
            p = int(d["after_pass"])
            if not 0 <= p < f:
                raise PolestarError(f"k-means state after pass {p} beyond the bound {f}")
            n = int(d["L"])
            if n > w:
                raise PolestarError(f"k-means window of {n} rows exceeds the run's window of {w}")
            if int(d["k"]) != min(k, n):
                raise PolestarError(f"k-means after pass {p} has k={d['k']}, expected {min(k, n)}")
            idx = list(d.get("init_idx") or [])[:k]
            init[0, p, :len(idx)] = idx
            draws = d.get("reseed_draws") or []
            if len(draws) > it:
                raise PolestarError(f"k-means after pass {p}: {len(draws)} re-seed draws for {it} iterations")
            for j, r in enumerate(draws):
                reseed[0, p, j, :len(r)] = np.asarray(r, np.int32)[:k]
            if force_labels and d.get("labels") is not None:
                lab = np.frombuffer(d["labels"].encode(), np.uint8).astype(np.int32) - ord("0")
                if len(lab) != n or lab.min() < 0 or lab.max() >= k:
                    raise PolestarError(f"k-means after pass {p}: labels are not {n} digits below {k}")
                labels[0, p, :n] = lab
                forced[0, p] = True
        elif kind == "refresh_topk" and force_topk:
            p = int(d["before_pass"]) - 1
            if not 0 <= p < f:
                raise PolestarError(f"refresh selection before pass {p + 1} beyond the bound {f}")
            topk[0, p] = False
            for c in d["clusters"]:
                topk[0, p, int(c)] = True
            topk_forced[0, p] = True
    return VReplay(*(jnp.asarray(a) for a in (init, reseed, labels, forced, topk, topk_forced)))
