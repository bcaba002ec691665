"""Builds a :class:`polestar_jax.decode.polestar.draws.Replay` from a PyTorch Polestar trace and decisions file.

Trace (``traces/<run>.trace.json -> traces[case]``): ``kmeans[]`` (one record per k-means call, in call
order: per block pass, layer 0 prefix, layer 0 suffix, layer 1 prefix, ...) and ``rng[]`` (every random draw
in order: a ``randperm`` per k-means call with more points than clusters, then one ``randint`` per
iteration that had an empty cluster). Decisions (``decisions/<run>_case<i>.json``): ``kmeans_it0..`` labels
per (call, layer, side) and ``topk`` cluster selections per (call, layer).
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from polestar_jax.config import ModelConfig, PolestarConfig
from polestar_jax.errors import PolestarError


def build_replay(trace: dict, decisions: list, cfg: ModelConfig, pc: PolestarConfig, block: int,
                 max_forwards: int):
    """Replay arrays for one case (batch 1). ``max_forwards``: an upper bound of the case's NFE."""
    import jax.numpy as jnp

    from polestar_jax.decode.polestar.draws import Replay

    n, k, it = cfg.n_layers, pc.n_clusters, pc.kmeans_iters
    wp, ws = pc.prefix_rows(block), pc.suffix_rows(block)
    f = max_forwards
    km_init = np.zeros((1, f, n, 2, k), np.int32)
    km_reseed = np.zeros((1, f, n, 2, it, k), np.int32)
    km_lp = np.zeros((1, f, n, it, wp), np.int32)
    km_ls = np.zeros((1, f, n, it, max(ws, 0)), np.int32)
    km_forced = np.zeros((1, f, n, 2), bool)
    topk = np.zeros((1, f, n, k), bool)
    topk_forced = np.zeros((1, f, n), bool)

    labels = defaultdict(dict)  # (call, layer, side) -> {iteration: labels}
    order: list[tuple[int, int, str]] = []
    for d in decisions:
        kind = d.get("kind", "")
        if kind.startswith("kmeans_it"):
            key = (int(d["call"]), int(d["layer"]), d["side"])
            if key not in labels:
                order.append(key)
            labels[key][int(kind[len("kmeans_it"):])] = d["value"]
        elif kind == "topk":
            c, layer = int(d["call"]), int(d["layer"])
            if c >= f:
                raise PolestarError(f"decision at forward {c} beyond the bound {f}")
            topk[0, c, layer, :] = False
            for v in d["value"]:
                topk[0, c, layer, int(v)] = True
            topk_forced[0, c, layer] = True

    for key in order:
        c, layer, side = key
        s = 0 if side == "pre" else 1
        buf = km_lp if s == 0 else km_ls
        its = labels[key]
        if len(its) != it:
            raise PolestarError(f"k-means labels of call {c} layer {layer} {side}: {len(its)} iterations, "
                                f"expected {it}")
        for i in range(it):
            v = np.asarray(its[i], np.int32)
            if len(v) > buf.shape[-1]:
                raise PolestarError(f"k-means window of {len(v)} points exceeds the {side} window")
            buf[0, c, layer, i, : len(v)] = v
        km_forced[0, c, layer, s] = True

    # random draws: walk the k-means records in order, matched to (call, layer, side) by order
    # (a trivial call, n <= k points, draws nothing and has no labels to inject: the Dream trace lists it)
    records = [r for r in trace.get("kmeans", []) if not r.get("trivial")]
    rng = list(trace.get("rng", []))
    if order and len(records) != len(order):
        raise PolestarError(f"trace has {len(records)} k-means calls but decisions list {len(order)}")
    pos = 0
    for rec, key in zip(records, order or [None] * len(records)):
        if key is None:
            break
        c, layer, side = key
        s = 0 if side == "pre" else 1
        kk = int(rec["k"])
        if int(rec["call"]) != c:
            raise PolestarError(f"k-means record order differs from the decisions at call {c}")
        if int(rec["L"]) > kk:
            if pos >= len(rng) or rng[pos].get("fn") != "randperm":
                raise PolestarError(f"expected a randperm draw for call {c} layer {layer} {side}")
            perm = rng[pos]["perm"]
            pos += 1
            km_init[0, c, layer, s, :kk] = perm[:kk]
        for j in range(int(rec.get("empty_reseed_draws", 0))):
            if pos >= len(rng) or rng[pos].get("fn") != "randint":
                raise PolestarError(f"expected a randint draw for call {c} layer {layer} {side}")
            if j < it:
                out = rng[pos]["out"]
                km_reseed[0, c, layer, s, j, : len(out)] = out
            pos += 1
    return Replay(*(jnp.asarray(a) for a in (km_init, km_reseed, km_lp, km_ls, km_forced, topk, topk_forced)))
