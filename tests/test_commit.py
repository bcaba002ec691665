"""Unit tests of the commit rules (``polestar_jax.decode.commit``) against straightforward Python ports."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax.decode import commit as C

T = 12  # block length of the random tests
R = 256  # rows of every commit-rule call (one shape: each jitted rule compiles once)
MASK = 9  # mask id of the random logits tests (vocab 16)

_fixed = jax.jit(C.commit_fixed)
_threshold = jax.jit(C.commit_threshold)
_factor = jax.jit(C.commit_factor)
_schedule = jax.jit(C.fixed_schedule, static_argnums=1)


def _rows(*conf_rows: list[float]) -> tuple[jax.Array, jax.Array]:
    """Hand-written confidence rows (-inf = not a candidate) padded to the common [R, T] shape."""
    conf = np.full((R, T), -np.inf, np.float32)
    for r, row in enumerate(conf_rows):
        conf[r, : len(row)] = row
    return jnp.asarray(conf), jnp.asarray(np.isfinite(conf))


def _random_conf(rng: np.random.Generator, rows: int, quantize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(conf, masked) [rows, T]: random candidate sets (some rows with 0 or 1 candidate), confidences in
    [0, 1] (quantized to create ties), -inf off candidates as :func:`commit.predict` returns them."""
    masked = rng.random((rows, T)) < rng.uniform(0.1, 1.0, (rows, 1))
    masked[0] = False  # n = 0
    masked[1] = False
    masked[1, rng.integers(T)] = True  # n = 1
    masked[2] = True  # all candidates
    conf = rng.random((rows, T))
    if quantize:
        conf = np.round(conf * 4) / 4  # many exact ties, including 0 and 1
    conf = np.where(masked, conf, -np.inf).astype(np.float32)
    return conf, masked


def _ranked(conf_row: np.ndarray, masked_row: np.ndarray) -> list[int]:
    """Candidates by descending confidence, ties towards the lowest index."""
    return sorted(np.flatnonzero(masked_row).tolist(), key=lambda j: (-float(conf_row[j]), j))


# --------------------------------------------------------------------------------------------- fixed
def _llada_num_transfer_tokens(n: int, steps: int) -> list[int]:
    """LLaDA ``get_num_transfer_tokens``: base = n // steps, the first n % steps steps take one more."""
    base, rem = divmod(n, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 7, 8, 16, 32, 33])
def test_fixed_schedule_matches_llada(steps):
    ns = np.arange(0, 70, dtype=np.int32)
    want = np.array([_llada_num_transfer_tokens(int(n), steps) + [0, 0] for n in ns])  # [n, steps + 2]
    got = np.stack([np.asarray(_schedule(jnp.asarray(ns), steps, jnp.full(ns.shape, i, jnp.int32)))
                    for i in range(steps + 2)], axis=1)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got.sum(1), ns)  # the schedule spreads exactly n tokens


def test_fixed_schedule_per_row_step():
    """``i`` may be an array (one step index per row)."""
    rng = np.random.default_rng(0)
    ns = rng.integers(0, 70, 70).astype(np.int32)
    i = rng.integers(0, 6, 70).astype(np.int32)
    want = [(_llada_num_transfer_tokens(int(n), 4) + [0, 0])[k] for n, k in zip(ns, i)]
    np.testing.assert_array_equal(np.asarray(_schedule(jnp.asarray(ns), 4, jnp.asarray(i))), want)


@pytest.mark.parametrize("quantize", [False, True])
def test_commit_fixed_top_k_ties_to_lowest_index(quantize):
    rng = np.random.default_rng(1 + quantize)
    conf, masked = _random_conf(rng, R, quantize)
    k = rng.integers(0, T + 2, R).astype(np.int32)
    got = np.asarray(_fixed(jnp.asarray(conf), jnp.asarray(masked), jnp.asarray(k)))
    for r in range(R):
        ranked = _ranked(conf[r], masked[r])
        want = np.zeros(T, bool)
        want[ranked[: k[r]]] = True
        np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}: k={k[r]} conf={conf[r]}")
        assert got[r].sum() == min(int(k[r]), int(masked[r].sum()))


def test_rank_desc_ties():
    conf, _ = _rows([0.5, 0.9, 0.5, -np.inf, 0.9, 0.1])
    np.testing.assert_array_equal(np.asarray(jax.jit(C.rank_desc)(conf))[0, :6], [2, 0, 3, 5, 1, 4])


# ----------------------------------------------------------------------------------------- threshold
@pytest.mark.parametrize("threshold", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_commit_threshold(threshold):
    rng = np.random.default_rng(int(threshold * 100))
    conf, masked = _random_conf(rng, R, quantize=True)  # confidences exactly at the threshold included
    got = np.asarray(_threshold(jnp.asarray(conf), jnp.asarray(masked), threshold))
    for r in range(R):
        assert not np.any(got[r] & ~masked[r]), f"row {r}: a non-candidate was committed"
        ranked = _ranked(conf[r], masked[r])
        if not ranked:
            assert not got[r].any()
            continue
        assert got[r, ranked[0]], f"row {r}: the most confident candidate was not committed"
        others = [j for j in ranked[1:] if got[r, j]]
        assert all(conf[r, j] >= threshold for j in others), f"row {r}: committed below the threshold"
        want = {ranked[0]} | {j for j in ranked if conf[r, j] >= threshold}
        assert set(np.flatnonzero(got[r]).tolist()) == want, f"row {r}"


def test_commit_threshold_top1_tie_goes_to_lowest_index():
    conf, masked = _rows([-np.inf, 0.3, 0.2, 0.3, -np.inf])
    got = np.asarray(_threshold(conf, masked, 0.9))
    np.testing.assert_array_equal(np.flatnonzero(got), [1])


# -------------------------------------------------------------------------------------------- factor
def _fastdllm_dynamic(conf_row: np.ndarray, masked_row: np.ndarray, factor: float) -> set[int]:
    """A plain port of Fast-dLLM ``get_transfer_index_dynamic`` for one row."""
    n = int(masked_row.sum())
    if n == 0:
        return set()
    ns = list(range(1, n + 1))
    threshs = [1 - factor / (k + 1) for k in ns]  # threshs[i] = 1 - factor / (i + 2)
    threshs[0] = -1
    ranked = _ranked(conf_row, masked_row)
    sorted_conf = [float(conf_row[j]) for j in ranked]
    top_i = 0
    for top_i in range(len(threshs)):  # ends on the first failing index, or n - 1 if none fails
        if sorted_conf[top_i] < threshs[top_i]:
            break
    if top_i == 0 or top_i == len(threshs) - 1:
        top_i += 1
    return set(ranked[:top_i])


@pytest.mark.parametrize("factor", [0.1, 0.5, 1.0, 2.0])
def test_commit_factor_matches_fastdllm(factor):
    rng = np.random.default_rng(int(factor * 10))
    rows = R
    conf, masked = _random_conf(rng, rows, quantize=False)
    # confidences near 1 so that long runs pass (the thresholds approach 1 as the index grows)
    conf = np.where(masked, 1 - (1 - conf) ** rng.uniform(1, 8, (rows, 1)), -np.inf).astype(np.float32)
    conf[3:6] = np.where(masked[3:6], 1.0, -np.inf)  # everything passes
    got = np.asarray(_factor(jnp.asarray(conf), jnp.asarray(masked), factor))
    counts = []
    for r in range(rows):
        want = _fastdllm_dynamic(conf[r], masked[r], factor)
        assert set(np.flatnonzero(got[r]).tolist()) == want, (f"row {r}: factor={factor} n={masked[r].sum()} "
                                                              f"conf={conf[r].tolist()}")
        counts.append(len(want))
    n = masked.sum(1)
    # the random rows exercise every branch: none, one, a partial count, all candidates
    assert 0 in counts and 1 in counts
    assert any(0 < c < m for c, m in zip(counts, n) if m > 2) or factor < 0.2
    assert any(c == m > 2 for c, m in zip(counts, n))


def test_commit_factor_quirk_last_candidate():
    """The first failure at the last candidate still commits all n (the reference's ``top_i += 1``)."""
    factor = 1.0  # thresholds -1, 2/3, 3/4, 4/5
    conf, masked = _rows([0.9, 0.9, 0.1, 0.9],  # sorted .9 .9 .9 .1: fails at index 3 = n-1 -> all 4
                         [0.5, 0.9, 0.9, 0.1, 0.1],  # fails at index 2 of 5 -> the 2 most confident
                         [0.9, 0.9, 0.9, 0.9],  # never fails -> all 4
                         [0.2, 0.1],  # n = 2: fails at index 1 = n-1 -> both
                         [0.3])  # n = 1 -> 1
    got = np.asarray(_factor(conf, masked, factor))
    assert [np.flatnonzero(got[r]).tolist() for r in range(6)] == [[0, 1, 2, 3], [1, 2], [0, 1, 2, 3], [0, 1], [0], []]


# ------------------------------------------------------------------------------------------- predict
# One jitted predict, one logits shape [B, T, V] for every test below: three compiles in all (greedy, sampled,
# random remasking) instead of op-by-op dispatch.
B, V = 4, 16
_predict = jax.jit(C.predict, static_argnames=("mask_id", "random_remask"))


def _random_logits(rng, scale=3.0) -> np.ndarray:
    return (rng.standard_normal((B, T, V)) * scale).astype(np.float32)


def _keys(*seeds: int) -> jax.Array:
    """Raw threefry keys [B, 2] (uint32), one per row."""
    return jnp.asarray(np.stack([[0, s] for s in seeds]).astype(np.uint32))


def test_predict_never_returns_mask_and_conf_is_prob():
    rng = np.random.default_rng(0)
    logits = _random_logits(rng)
    logits[..., MASK] = 50.0  # the mask token is by far the most likely
    masked = rng.random(logits.shape[:2]) < 0.6
    pred = _predict(jnp.asarray(logits), jnp.asarray(masked), mask_id=MASK)
    x0, conf = map(np.asarray, pred)
    assert x0.dtype == np.int32 and not np.any(x0 == MASK)
    no_mask = logits.copy()
    no_mask[..., MASK] = -np.inf
    np.testing.assert_array_equal(x0, no_mask.argmax(-1))
    # confidence = probability of x0 under the full (un-perturbed) softmax, mask token included
    p = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.take_along_axis(p, x0[..., None], -1)[..., 0]
    np.testing.assert_allclose(conf[masked], want[masked], rtol=1e-4, atol=1e-30)
    np.testing.assert_array_equal(conf[~masked], -np.inf)
    assert np.all(np.isfinite(conf[masked]))


def test_one_pass_top1_equals_the_two_pass_form():
    """The accelerators' one-pass top-1 (an online softmax in one variadic reduction) picks the same token as
    the two-pass form the golden replays were made with, ties to the lowest id and the mask token excluded
    even where it is the largest logit, with the same probability up to rounding; on the CPU ``predict``
    keeps the two-pass numerics bit for bit."""
    rng = np.random.default_rng(3)
    logits = _random_logits(rng) * 3
    logits[0, 0, MASK] = 80.0  # the mask token is the maximum: excluded from x0, included in the softmax
    logits[0, 1, [2, 4]] = 60.0  # a tie: the lower id wins
    logits[1, 2, :] = 0.0  # a flat row: every id ties
    logits = jnp.asarray(logits)
    not_mask = jnp.arange(logits.shape[-1]) != MASK
    x_two, p_two = map(np.asarray, C.top1_two_pass(logits, not_mask))
    x_one, p_one = map(np.asarray, jax.jit(C.top1_one_pass)(logits, not_mask))
    np.testing.assert_array_equal(x_one, x_two)
    assert x_one[0, 1] == 2 and x_one[1, 2] == 0 and x_one[0, 0] != MASK
    np.testing.assert_allclose(p_one, p_two, rtol=1e-5, atol=1e-30)
    pred = C.predict(logits, jnp.ones(logits.shape[:2], bool), MASK)
    np.testing.assert_array_equal(np.asarray(pred.x0), x_two)
    np.testing.assert_array_equal(np.asarray(pred.conf), p_two)
    # sampling: the argmax of perturbed scores, the probability under the un-perturbed softmax
    scored = logits + 2.0 * jnp.asarray(rng.gumbel(size=logits.shape).astype(np.float32))
    x_two, p_two = map(np.asarray, C.top1_two_pass(scored, not_mask, logits))
    x_one, p_one = map(np.asarray, jax.jit(C.top1_one_pass)(scored, not_mask, logits))
    np.testing.assert_array_equal(x_one, x_two)
    np.testing.assert_allclose(p_one, p_two, rtol=1e-5, atol=1e-30)


def test_predict_with_noise_never_returns_mask():
    rng = np.random.default_rng(1)
    logits = _random_logits(rng)
    logits[..., MASK] = 20.0
    masked = jnp.ones((B, T), bool)
    for temperature in (0.5, 5.0, 100.0):
        pred = _predict(jnp.asarray(logits), masked, temperature=jnp.float32(temperature), noise_keys=_keys(1, 2, 3, 4),
                        mask_id=MASK)
        assert not np.any(np.asarray(pred.x0) == MASK), temperature


def test_predict_temperature_keys():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(_random_logits(rng, scale=0.3))  # flat: the noise decides
    masked_np = rng.random((B, T)) < 0.7
    masked = jnp.asarray(masked_np)
    t = jnp.float32(1.0)
    a1 = _predict(logits, masked, temperature=t, noise_keys=_keys(0, 1, 2, 3), mask_id=MASK)
    a2 = _predict(logits, masked, temperature=t, noise_keys=_keys(0, 1, 2, 3), mask_id=MASK)
    b = _predict(logits, masked, temperature=t, noise_keys=_keys(10, 11, 12, 13), mask_id=MASK)
    np.testing.assert_array_equal(np.asarray(a1.x0), np.asarray(a2.x0))
    np.testing.assert_array_equal(np.asarray(a1.conf), np.asarray(a2.conf))
    assert np.mean(np.asarray(a1.x0) != np.asarray(b.x0)) > 0.3
    greedy = np.asarray(_predict(logits, masked, mask_id=MASK).x0)
    assert np.mean(np.asarray(a1.x0) != greedy) > 0.3
    # the confidence stays the un-perturbed probability of the sampled token, -inf off candidates
    p = np.asarray(jax.nn.softmax(logits, -1))
    x0 = np.asarray(a1.x0)
    want = np.where(masked_np, np.take_along_axis(p, x0[..., None], -1)[..., 0], -np.inf)
    np.testing.assert_allclose(np.asarray(a1.conf), want, rtol=1e-5)
    # each row uses its own key: rows 0-1 do not depend on the keys of rows 2-3
    mixed = _predict(logits, masked, temperature=t, noise_keys=_keys(0, 1, 12, 13), mask_id=MASK)
    np.testing.assert_array_equal(np.asarray(mixed.x0)[:2], x0[:2])
    np.testing.assert_array_equal(np.asarray(mixed.x0)[2:], np.asarray(b.x0)[2:])


def test_predict_random_remasking_confidences():
    rng = np.random.default_rng(4)
    logits = jnp.asarray(_random_logits(rng))
    masked = np.asarray(rng.random((B, T)) < 0.5)
    masked[:, 0] = True
    pred = _predict(logits, jnp.asarray(masked), temperature=jnp.float32(0.0), noise_keys=_keys(5, 6, 7, 8),
                    mask_id=MASK, random_remask=True)
    conf = np.asarray(pred.conf)
    np.testing.assert_array_equal(conf[~masked], -np.inf)
    assert np.all((conf[masked] >= 0) & (conf[masked] < 1))
    prob = np.asarray(jax.nn.softmax(logits, axis=-1))
    prob_x0 = np.take_along_axis(prob, np.asarray(pred.x0)[..., None], axis=-1)[..., 0]
    assert not np.allclose(conf[masked], prob_x0[masked])  # uniform draws, not probabilities
    # at temperature 0 the tokens are the greedy ones: the keys only feed the draws
    np.testing.assert_array_equal(np.asarray(pred.x0), np.asarray(_predict(logits, jnp.asarray(masked), mask_id=MASK).x0))
