"""Weight-only int8 quantization (:mod:`polestar_jax.models.quant`): the per-element error bound, the products'
error bounds against the float weights, every family's int8 model = the float model of its dequantized weights,
the trained test bed's answers, the command line's ``--weights`` and the memory plan. The int8 K/V cache
(:mod:`polestar_jax.models.kv_quant`, ``--kv-cache int8``): the attention's error bound against the float cache,
what a full pass writes, a cached step on the golden tiny model (Polestar's block start and refresh step too),
no whole-cache copy in the compiled programs, the test bed's answers (fixed and running batch, polestar_v),
the flag, the plan and the refusals."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax import api
from polestar_jax import generate as gen_cli
from polestar_jax.config import DecodeConfig, PolestarConfig
from polestar_jax.decode import samplers
from polestar_jax.decode.layout import init_decode_state
from polestar_jax.decode.policy import EngineSpec
from polestar_jax.errors import ConfigError
from polestar_jax.io.checkpoint import load_model
from polestar_jax.io.tokenizer import asset_model_dir
from polestar_jax.models import kv_quant, llada, quant
from polestar_jax.models.family import family_of

F32_EPS = float(jnp.finfo(jnp.float32).eps)


def _weights(dtype, shape=(3, 40, 24)):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[..., 5] = 0.0  # an all-zero output channel
    w[..., 7] *= 1e-6  # a tiny one
    return jnp.asarray(w, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("axis", [-2, -1])
def test_quantize_error_is_at_most_half_a_scale(dtype, axis):
    w = _weights(dtype)
    qt = quant.quantize(w, axis)
    assert qt.q.dtype == jnp.int8 and qt.scale.dtype == dtype and qt.shape == w.shape
    assert qt.scale.shape[axis] == 1 and int(jnp.max(jnp.abs(qt.q.astype(jnp.int32)))) <= 127
    wf, s = w.astype(jnp.float32), qt.scale.astype(jnp.float32)
    err = jnp.abs(wf - quant.dequantize(qt, jnp.float32))
    assert bool(jnp.all(err <= s / 2 * (1 + 4 * F32_EPS)))
    # each channel's largest weight is 127 steps (absmax scaling; a bf16 scale rounded up by at most 2^-8 of
    # itself may make it 126.5 steps: 126), an all-zero channel stays zero
    amax_q = jnp.max(jnp.abs(qt.q.astype(jnp.int32)), axis=axis)
    nonzero = jnp.max(jnp.abs(wf), axis=axis) > 0
    assert bool(jnp.all(jnp.where(nonzero, amax_q >= (127 if dtype == jnp.float32 else 126), amax_q == 0)))
    assert quant.dequantize(w) is w  # a float weight is its own dequantization


def test_products_are_bounded_by_the_weight_error():
    """``|x @ W - matmul(x, Q)| <= |x| @ (scale / 2)`` (plus float32 rounding) per output; the same for the
    head and the embedding rows; float weights take the float code bit for bit."""
    rng = np.random.default_rng(1)
    w = _weights(jnp.float32, (40, 24))
    x = jnp.asarray(rng.standard_normal((2, 5, 40)), jnp.float32)
    qt = quant.quantize(w)
    bound = jnp.sum(jnp.abs(x), -1, keepdims=True) * qt.scale[0] / 2  # [2, 5, 24]: sum_i |x_i| * scale_j / 2
    slack = 64 * F32_EPS * (jnp.abs(x) @ jnp.abs(w))
    for got in (quant.matmul(x, qt), quant.head(x, qt)):
        assert bool(jnp.all(jnp.abs(got - x @ w) <= bound + slack))
    np.testing.assert_array_equal(quant.matmul(x, w), x @ w)
    np.testing.assert_array_equal(quant.head(x, w), jnp.einsum("btd,dv->btv", x, w))
    ids = jnp.asarray([[0, 3, 39]])
    rows = quant.quantize(w, -1)
    assert bool(jnp.all(jnp.abs(quant.take_rows(rows, ids) - w[ids]) <= jnp.take(rows.scale, ids, axis=0) / 2))
    np.testing.assert_array_equal(quant.take_rows(w, ids), jnp.take(w, ids, axis=0))


@pytest.fixture(scope="module")
def moe():
    return load_model(asset_model_dir("tiny_moe"), dtype="float32")


@pytest.mark.parametrize("which", ["tiny_a", "dream", "moe"])
def test_int8_model_is_the_float_model_of_its_dequantized_weights(which, request):
    """LLaDA, Dream and LLaDA-MoE (its experts included): the int8 model's logits are those of the float model
    whose weights are ``q * scale``, to float32 rounding; what quantization changed is the weights alone."""
    cfg, params = request.getfixturevalue(which)
    qparams = quant.quantize_params(params)
    names = {k for k, v in {**qparams, **qparams["blocks"]}.items() if quant.is_qtensor(v)}
    want = {"wte", "lm_head", "wq", "wk", "wv", "wo"} | (
        {"e_gate", "e_up", "e_down"} if cfg.moe else {"w_gate", "w_up", "w_down"})
    assert names == want and quant.weights_mode(qparams) == "int8" and quant.weights_mode(params) == "float"
    assert quant.weight_bytes(qparams) < quant.weight_bytes(params) / 3  # float32 -> int8 (+ scales)
    deq = jax.tree.map(lambda x: quant.dequantize(x, jnp.float32), qparams, is_leaf=quant.is_qtensor)
    fam = family_of(cfg)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    got, ref = fam.logits(qparams, ids, cfg), fam.logits(deq, ids, cfg)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(ref))))
    assert float(jnp.max(jnp.abs(fam.logits(params, ids, cfg) - got))) > 0  # (the weights did change)


#: held-out prompts of the trained test bed (bench/tasks' eval seeds) and the decoder they run with
_PROMPTS = ["copy: ann,bob,cal,dan", "reverse: eve,fay,gus", "sort: tom,bob,ivy,ann", "add: 123+456",
            "copy: hal,ivy", "reverse: ann,bob,cal,dan,eve"]


def test_int8_tiny_tasks_answers_as_the_float_model():
    """The bundled trained model (float32) and its int8 weights answer held-out prompts alike (measured:
    docs/scaling.md#int8-weights)."""
    f = api.load(compile_cache=False)
    q = api.load(compile_cache=False, weights="int8")
    assert q.engine.dtype == f.engine.dtype == jnp.float32 and q.weights == "int8"
    a = [g.text for g in f.generate(_PROMPTS, decoder="llada")]
    b = [g.text for g in q.generate(_PROMPTS, decoder="llada")]
    assert sum(x == y for x, y in zip(a, b)) >= len(_PROMPTS) - 1, (a, b)


def _main(argv, capsys):
    try:
        code = gen_cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_weights_flag_and_plan(capsys, monkeypatch):
    """``generate --weights int8`` answers; ``--dry-run --weights int8`` plans the int8 bytes: each matmul
    weight at one byte per value plus one bf16 scale per output channel."""
    monkeypatch.setenv("POLESTAR_JAX_CACHE", "off")
    cfg = api.ModelConfig.from_json(asset_model_dir("tiny_tasks") + "/config.json")
    code, out, err = _main(["--prompt", "copy: ann,bob,cal", "--decoder", "llada", "--weights", "int8", "--json"],
                           capsys)
    assert code == 0, err
    assert json.loads(out)["rows"][0]["text"] == "ann,bob,cal"
    code, out, err = _main(["--dry-run", "--weights", "int8", "--dtype", "bfloat16", "--decoder", "llada", "--json"],
                           capsys)
    assert code == 0, err
    assert "weights=int8" in out
    from polestar_jax.engine.plan import plan

    dcfg = DecodeConfig(decoder="llada", cache="none", gen_length=32, block_length=32, threshold=None)
    plans = {w: plan(cfg, dcfg, compile_step=False, weights=w).param_bytes for w in ("float", "int8")}
    assert json.loads(out.strip().splitlines()[-1])["param_bytes"] == plans["int8"]
    d, f, v, hq, hk = (cfg.d_model, cfg.mlp_hidden_size, cfg.embedding_size, cfg.n_heads * cfg.head_dim,
                       cfg.n_kv_heads * cfg.head_dim)
    # bf16 -> int8 halves each quantized weight (2 bytes -> 1); one bf16 scale per output channel is added
    values = 2 * v * d + cfg.n_layers * (d * hq + 2 * d * hk + hq * d + 3 * d * f)
    scales = 2 * v + cfg.n_layers * (hq + 2 * hk + d + 2 * f + d)
    assert plans["float"] - plans["int8"] == values - 2 * scales


def test_bad_weights_value_is_one_line(capsys):
    code, out, err = _main(["--prompt", "x", "--weights", "int4"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "int4" in lines[0] and "Traceback" not in err
    with pytest.raises(ConfigError, match="unknown weights mode 'int4'"):
        api.load(weights="int4", compile_cache=False)


# ---------------------------------------------------------------------------------------- the int8 K/V cache

def test_int8_cache_attention_is_bounded_by_the_cache_error():
    """Attention over an int8 cache is attention over its dequantized keys and values (to float32 rounding:
    the scales are applied to the scores and probabilities), and differs from attention over the float
    cache by at most ``(exp(2 D) - 1) max|v'| + max(v_scale) / 2`` per query row, where
    ``D = max_l sum_d |q_d| k_scale_l / 2 / sqrt(hd)`` bounds the change of any score (a softmax whose
    inputs move by at most D moves each probability by a factor within exp(+-2 D))."""
    rng = np.random.default_rng(0)
    b, h, kvh, t, length, hd = 2, 4, 2, 3, 10, 16
    q = jnp.asarray(rng.standard_normal((b, h, t, hd)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, kvh, length, hd)) * 2, jnp.float32).at[0, 1, 4].set(0.0)
    v = jnp.asarray(rng.standard_normal((b, kvh, length, hd)), jnp.float32)
    valid = jnp.asarray(rng.random((b, length)) > 0.2).at[:, 0].set(True)
    like = kv_quant.empty((b, kvh, length, hd), jnp.float32, "int8")
    kq, vq = kv_quant.stored(k, like), kv_quant.stored(v, like)
    assert kq.q.dtype == jnp.int8 and kq.scale.shape == (b, kvh, length, 1) and kv_quant.stored(kq, like) is kq
    got = llada.attention(q, kq, vq, valid)
    deq = llada.attention(q, kv_quant.read(kq), kv_quant.read(vq), valid)
    np.testing.assert_allclose(got, deq, rtol=1e-5, atol=1e-6)
    ref = llada.attention(q, k, v, valid)
    g = h // kvh
    ks = jnp.repeat(kq.scale[..., 0], g, axis=1)  # [b, H, L] each query head's KV head's scales
    vs = jnp.repeat(vq.scale[..., 0], g, axis=1)
    vmax = jnp.repeat(jnp.max(jnp.abs(kv_quant.read(vq)), -1), g, axis=1)  # [b, H, L]
    on = valid[:, None, :]
    d = jnp.max(jnp.where(on[:, :, None], jnp.sum(jnp.abs(q), -1)[..., None] * ks[:, :, None] / 2, 0), -1)
    d = d / jnp.sqrt(jnp.float32(hd))  # [b, H, T]
    bound = (jnp.expm1(2 * d) * jnp.max(jnp.where(on, vmax, 0), -1)[..., None]
             + jnp.max(jnp.where(on, vs, 0), -1)[..., None] / 2)
    err = jnp.max(jnp.abs(got - ref), -1)
    assert bool(jnp.all(err <= bound * (1 + 1e-4) + 1e-6)), float(jnp.max(err - bound))
    assert float(jnp.max(err)) > 0  # (the cache did change)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_int8_cache_cluster_drift_reads_the_scales(backend):
    """Polestar's cluster drift over an int8 layer of un-rotated keys is the drift over its dequantized keys
    (to float32 rounding): the jnp path applies each key's scale to its scores, a kernel (here the
    interpreter) takes the layer dequantized."""
    from polestar_jax.decode.polestar.drift import cluster_drift
    from polestar_jax.kernels.kl_drift import kl_drift_reference

    rng = np.random.default_rng(3)
    b, h, kvh, t, length, hd = 2, 4, 2, 3, 16, 16
    q = jnp.asarray(rng.standard_normal((b, h, t, hd)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, kvh, length, hd)) * 2, jnp.float32)
    valid = jnp.asarray(rng.random((b, length)) > 0.2).at[:, 0].set(True)
    s_prev = jax.nn.softmax(jnp.asarray(rng.standard_normal((b, h, t, length)), jnp.float32), -1)
    kq = kv_quant.stored(k, kv_quant.empty(k.shape, jnp.float32, "int8"))
    got = cluster_drift(q, kq, valid, s_prev, backend)
    want = kl_drift_reference(q, kv_quant.read(kq), valid, s_prev, mode="cluster")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _cached_pass(params, cfg, prompts, dcfg):
    """(full-pass block logits, the cache it wrote, the next cached step's block logits) of the first block."""
    slot = 48
    state = init_decode_state(cfg, dcfg, prompts, slot, dtype=jnp.float32)
    spec = EngineSpec.from_config(cfg, dcfg)

    @jax.jit
    def run(params, state):
        start, state = samplers.full_forward(params, state, spec, slot, keep_cache=True)
        step, _ = samplers.cached_forward(params, state, spec, slot)
        return start, (state.k_cache, state.v_cache), step

    return run(params, state)


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_int8_cache_pass_and_step_on_the_golden_model(tiny_a, tiny_a_cases, cache):
    """The full pass is unchanged (it attends to its own float K/V) and writes the int8 cache of the float
    pass's K/V, every entry within half a scale; the next cached step (the same tokens, so in float it
    repeats the full pass's logits) reads the int8 cache: its logits stay close to the float step's and
    agree on the top token (measured: docs/scaling.md#int8-kv-cache)."""
    cfg, params = tiny_a
    prompts = [c["prompt_ids"] for c in tiny_a_cases["generate_cases"][:3]]
    base = dict(decoder="fastdllm", cache=cache, gen_length=32, block_length=16)
    f_start, (fk, fv), f_step = _cached_pass(params, cfg, prompts, DecodeConfig(**base))
    q_start, (qk, qv), q_step = _cached_pass(params, cfg, prompts, DecodeConfig(**base, kv_cache="int8"))
    np.testing.assert_array_equal(q_start, f_start)
    for fc, qc in ((fk, qk), (fv, qv)):
        assert qc.q.dtype == jnp.int8 and qc.scale.dtype == jnp.float32 and qc.q.shape == fc.shape
        np.testing.assert_array_equal(qc.q, quant.quantize(fc, -1).q)
        assert bool(jnp.all(jnp.abs(kv_quant.read(qc) - fc) <= qc.scale / 2 * (1 + 4 * F32_EPS)))
    np.testing.assert_allclose(f_step, f_start, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(f_start))))
    err = float(jnp.max(jnp.abs(q_step - f_step)))
    spread = float(jnp.max(f_step) - jnp.min(f_step))
    assert 0 < err <= 0.02 * spread, (err, spread)
    agree = float(jnp.mean(jnp.argmax(q_step, -1) == jnp.argmax(f_step, -1)))
    assert agree >= 0.9, agree


def _polestar_start_and_step(params, cfg, prompts, dcfg):
    """Polestar's block 0 start and its first decode step (a refresh of every row): (the cache the start
    wrote, the tokens it committed, the step's block logits, cluster drift scores [N, b, K])."""
    from polestar_jax.decode.polestar.policy import block_start
    from polestar_jax.decode.polestar.state import geometry
    from polestar_jax.decode.polestar.step import step_forward

    slot, block, pc = 48, dcfg.block_length, dcfg.polestar
    state = init_decode_state(cfg, dcfg, prompts, slot, dtype=jnp.float32)

    @jax.jit
    def run(params, state):
        state = block_start(params, state, 0, cfg, dcfg)
        geo = geometry(state, jnp.int32(slot), block, pc)
        out = step_forward(params, state, geo, cfg, pc, block, True, jnp.ones((len(prompts),), bool), None)
        return (state.k_cache, state.v_cache), state.x, out.logits, out.scores

    return run(params, state)


def test_int8_cache_polestar_start_and_refresh_step(tiny_a, tiny_a_cases):
    """Polestar's block start attends to its own float K/V (so it commits the float cache's tokens) and
    writes the int8 cache of the float start's K/V; the next decode step refreshes every row, reading the
    int8 cache in its cluster drift, its refresh stages and the block's attention: its logits stay close to
    the float cache's and agree on the top token (the fastdllm bounds above)."""
    cfg, params = tiny_a
    prompts = [c["prompt_ids"] for c in tiny_a_cases["generate_cases"][:3]]
    base = dict(decoder="polestar", gen_length=32, block_length=16, polestar=PolestarConfig(refresh_buckets=1))
    (fk, fv), fx, f_step, f_scores = _polestar_start_and_step(params, cfg, prompts, DecodeConfig(**base))
    (qk, qv), qx, q_step, q_scores = _polestar_start_and_step(params, cfg, prompts,
                                                              DecodeConfig(**base, kv_cache="int8"))
    np.testing.assert_array_equal(qx, fx)
    for fc, qc in ((fk, qk), (fv, qv)):
        assert qc.q.dtype == jnp.int8 and qc.q.shape == fc.shape
        np.testing.assert_array_equal(qc.q, quant.quantize(fc, -1).q)
    assert bool(jnp.any(jnp.isfinite(q_scores)))  # (the step did refresh: it scored clusters)
    err = float(jnp.max(jnp.abs(q_step - f_step)))
    spread = float(jnp.max(f_step) - jnp.min(f_step))
    assert 0 < err <= 0.02 * spread, (err, spread)
    agree = float(jnp.mean(jnp.argmax(q_step, -1) == jnp.argmax(f_step, -1)))
    assert agree >= 0.9, agree


def _whole_cache_ops(text: str, shape) -> dict:
    """How many copies, concatenations and dynamic-update-slices of the compiled program have the cache's
    ``shape`` (its layer axis included) as their result, by opcode."""
    import collections
    import re

    dims = r"\[" + ",".join(map(str, shape)) + r"\]"
    ops = (re.search(r"= \w+" + dims + r"\S* (copy|concatenate|dynamic-update-slice)\(", ln)
           for ln in text.splitlines())
    return dict(collections.Counter(m.group(1) for m in ops if m))


def test_int8_cache_polestar_program_copies_no_more_than_float(tiny_a):
    """Polestar's compiled running-batch block program (block start, refresh and plain steps) with the int8
    cache copies, concatenates or slice-updates no array the size of the whole cache (values or scales)
    more often than the float program does the float cache, and copies none: its passes read the int8
    layer where it lies and write rows in place (a block start's new layer is made before anything reads
    the old one, ``polestar.start.StartWrite``; without that XLA copied K and V, values and scales, every
    layer, where the float program copies the float cache)."""
    from engines import engine_for
    from polestar_jax.engine.engine import running_spec

    cfg, params = tiny_a
    eng = engine_for(params, cfg)
    ops = {}
    for mode in ("float", "int8"):
        dcfg = DecodeConfig(decoder="polestar", gen_length=32, block_length=8, kv_cache=mode,
                            polestar=PolestarConfig(refresh_buckets=1))  # (one refresh width: a shorter compile)
        state = eng.initial_state([[5, 6, 7, 8]] * 2, dcfg, 16, 0, [0, 1], [32, 32])
        fn, _ = eng.block_program(params, state, eng.knobs(dcfg, 2), running_spec(eng, dcfg, 2), None)
        text = fn.as_text()
        ops[mode] = [_whole_cache_ops(text, p.shape) for p in (state.k_cache if mode == "int8" else [state.k_cache])]
    (fl,) = ops["float"]
    assert fl.get("dynamic-update-slice"), ops  # (the cache is in the program, updated in place)
    for part in ops["int8"]:
        assert "copy" not in part and all(n <= fl.get(op, 0) for op, n in part.items()), ops


def test_int8_cache_steps_copy_no_whole_cache(tiny_a, decoder="fastdllm", cache="dual"):
    """The compiled block program (a running batch's: rows at their own blocks, one shared cache) holds the
    int8 cache and its scales and copies neither whole: rows are quantized where written, and a layer is
    read inside the attention (the design rule of the float cache, tests/test_engine.py; the same holds for
    the prefix cache and polestar_v, checked once by hand)."""
    import re

    from engines import engine_for

    cfg, params = tiny_a
    eng = engine_for(params, cfg)
    dcfg = DecodeConfig(decoder=decoder, cache=cache, gen_length=32, block_length=8, kv_cache="int8")
    state = eng.initial_state([[5, 6, 7, 8]] * 2, dcfg, 16, 0, [0, 1], [32, 32])
    from polestar_jax.engine.engine import running_spec

    fn, _ = eng.block_program(params, state, eng.knobs(dcfg, 2), running_spec(eng, dcfg, 2), None)
    text = fn.as_text()
    for part in state.k_cache:
        shape = r"\[" + ",".join(map(str, part.shape)) + r"\]"
        assert re.search(shape, text)  # the cache is in the program
        assert not [ln for ln in text.splitlines() if " copy(" in ln and re.search(shape, ln)], part.shape


def _shapes(text: str) -> set[tuple[int, ...]]:
    import re

    return {tuple(int(d) for d in m.split(",")) for m in re.findall(r"\[(\d+(?:,\d+)*)\]", text)}


@pytest.mark.parametrize("kv_cache", ["float", "int8"])
def test_compacted_chunks_share_the_cache(tiny_a, kv_cache):
    """A running batch stepping in chunks of rows (4 rows, chunks of 2; rows inserted at different times, so
    they sit at different blocks and finish apart) decodes each row exactly as the batch without chunks,
    with either cache, and its compiled program never holds a chunk's K/V (the rows read and write their
    own entries of the one cache, llada.chunk_entries): gathering a chunk's rows copied every layer of
    their cache in and out (on one v5e chip, 2.7 GiB more than the fixed batch of 32 at LLaDA-8B)."""
    from engines import engine_for

    from polestar_jax.engine.engine import RunningBatch

    cfg, params = tiny_a
    eng = engine_for(params, cfg)
    dcfg = DecodeConfig(decoder="fastdllm", cache="dual", gen_length=16, block_length=8, kv_cache=kv_cache)
    prompts = [[5, 6, 7, 8, 9][: n] + [3] * n for n in (2, 5, 3, 4, 1, 5)]
    outs = []
    for compact in (0, 2):
        batch = RunningBatch(eng, dcfg, 4, 16, compact_rows=compact)
        assert batch.spec.compact_rows == compact
        queue, out = list(range(len(prompts))), {}
        while queue or batch.occupied:
            if queue and batch.free_slots:  # (one insertion a block: the rows sit at different blocks)
                i = queue.pop(0)
                batch.insert(prompts[i], tag=i)
            batch.step()
            out.update({r.index: r for r in batch.finished()})
        outs.append(out)
        if compact:
            n, _, kv, length, hd = jax.tree.leaves(batch.state.k_cache)[0].shape
            chunk = {(n, 2, kv, length, hd), (2, n, kv, length, hd), (n, 2, 1, kv, length, hd),
                     (2, n, 1, kv, length, hd)}
            assert not chunk & _shapes(batch.fn.as_text())
    for i in range(len(prompts)):
        np.testing.assert_array_equal(outs[1][i].tokens, outs[0][i].tokens)
        assert outs[1][i].nfe == outs[0][i].nfe


def test_int8_cache_tiny_tasks_answers_fixed_and_running_batch():
    """The bundled trained model with the dual cache answers held-out prompts alike with either cache; a
    running batch (rows inserted at block boundaries, each row's entries of one shared int8 cache) answers
    exactly as the fixed batch does; polestar_v answers alike with either prefix cache (polestar: measured by
    hand, docs/scaling.md#int8-kv-cache; its cached passes are checked on the golden model above)."""
    m = api.load(compile_cache=False)
    a = [g.text for g in m.generate(_PROMPTS, decoder="fastdllm")]
    b = [g.text for g in m.generate(_PROMPTS, decoder="fastdllm", kv_cache="int8")]
    assert sum(x == y for x, y in zip(a, b)) >= len(_PROMPTS) - 1, (a, b)
    c = [g.text for g in m.generate(_PROMPTS, decoder="fastdllm", kv_cache="int8", batch_size=4)]
    assert c == b
    d, e = ([g.text for g in m.generate(_PROMPTS, decoder="polestar_v", kv_cache=kv)] for kv in ("float", "int8"))
    assert sum(x == y for x, y in zip(d, e)) >= len(_PROMPTS) - 1, (d, e)


def test_kv_cache_flag_plan_and_refusals(capsys, monkeypatch):
    """``generate --kv-cache int8`` answers; the memory plan counts one byte per cached value plus one bf16
    scale per (layer, row, KV head, position); a decoder without a cache it could store, or an unknown
    value, is one line (exit 2)."""
    monkeypatch.setenv("POLESTAR_JAX_CACHE", "off")
    code, out, err = _main(["--prompt", "copy: ann,bob,cal", "--decoder", "fastdllm", "--kv-cache", "int8",
                            "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["rows"][0]["text"] == "ann,bob,cal"
    from polestar_jax.engine.plan import plan

    cfg = api.ModelConfig.from_json(asset_model_dir("tiny_tasks") + "/config.json")
    kv = {}
    for mode in ("float", "int8"):
        dcfg = DecodeConfig(decoder="fastdllm", cache="dual", gen_length=32, block_length=32, kv_cache=mode)
        kv[mode] = plan(cfg, dcfg, prompt_len=64, compile_step=False).kv_bytes_per_seq
    entries = 2 * cfg.n_layers * cfg.n_kv_heads * (64 + 32)  # K and V, every layer, KV head and position
    assert kv == {"float": entries * cfg.head_dim * 2, "int8": entries * (cfg.head_dim + 2)}
    for argv, word in ((["--kv-cache", "int4"], "int4"), (["--kv-cache", "int8", "--decoder", "llada"], "llada"),
                       (["--kv-cache", "int8", "--decoder", "fastdllm", "--cache", "none"], "none")):
        code, out, err = _main(["--prompt", "x", *argv], capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and word in lines[0] and "Traceback" not in err, err
    with pytest.raises(ConfigError, match="kv_cache int8 applies to decoder fastdllm with a cache .prefix or dual., "
                                          "polestar and polestar_v"):
        DecodeConfig(decoder="fastdllm", cache="none", kv_cache="int8")
    # polestar takes it (its passes read the int8 cache: test_int8_cache_polestar_start_and_refresh_step)
    dcfg = DecodeConfig(decoder="polestar", gen_length=32, block_length=32, kv_cache="int8")
    assert plan(cfg, dcfg, prompt_len=64, compile_step=False).kv_bytes_per_seq == kv["int8"]
    from polestar_jax.lm_eval_model import parse_model_args

    assert parse_model_args({"kv_cache": "int8", "decoder": "fastdllm"})[1]["kv_cache"] == "int8"


def test_int8_refresh_rows_by_layer_equal_in_place():
    """A refresh's quantized K/V rows written into the int8 cache both ways, in place into the stacked cache
    (a CPU's and a GPU's form) and through the layer's cache copied out and written back whole (a TPU's):
    the same stacked cache and the same layer, value for value, invalid and out-of-range rows dropped."""
    from polestar_jax.decode.polestar.step import rows_by_layer, rows_in_place

    rng = np.random.default_rng(3)
    n, b, kv, length, hd, c = 3, 2, 2, 11, 8, 4
    cache = lambda: kv_quant.stored(jnp.asarray(rng.standard_normal((n, b, kv, length, hd)), jnp.float32),
                                    kv_quant.empty((1, hd), jnp.float32, "int8"))
    slot = llada.CacheSlot((cache(), cache()), jnp.int32(1))
    rows = tuple(jnp.asarray(rng.standard_normal((b, kv, c, hd)), jnp.float32) for _ in range(2))
    idx = jnp.asarray([[0, 5, 10, 11], [3, -1, 7, 2]], jnp.int32)
    valid = jnp.asarray([[True, True, False, True], [True, True, True, False]])
    got = [jax.jit(f)(slot, rows, idx, valid) for f in (rows_in_place, rows_by_layer)]
    for x, y in zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[1])):
        np.testing.assert_array_equal(x, y)
    (s, (k, _)), old = got[0], slot.buffers[0]
    assert not np.array_equal(s.buffers[0].q[1], old.q[1]) and np.array_equal(s.buffers[0].q[0], old.q[0])
    want = quant.quantize(rows[0][0, :, 1], -1)  # row 0's entry at position 5
    np.testing.assert_array_equal(k.q[0, :, 5], want.q)
    np.testing.assert_array_equal(k.q[0, :, 10], old.q[1, 0, :, 10])  # (not valid: kept)


# ---------------------------------------------------------------------- the TPU forms, run on the CPU
def _kv(key, shape, int8: bool):
    x = jax.random.normal(key, shape, jnp.float32)
    return kv_quant.stored(x, kv_quant.empty(shape, jnp.float32, "int8")) if int8 else x


@pytest.mark.parametrize("int8", [False, True])
def test_attention_a_kv_head_at_a_time_equals_every_head_at_once(int8):
    """``llada.attention_by_heads`` (a TPU's full-pass attention: one KV head's float32 scores at a time)
    gives the exact path's values: GQA (4 query heads on 2 KV heads), padded keys, float or int8 K/V."""
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(ks[0], (2, 4, 16, 8), jnp.float32)
    k, v = _kv(ks[1], (2, 2, 16, 8), int8), _kv(ks[2], (2, 2, 16, 8), int8)
    valid = jnp.arange(16)[None] < jnp.array([[16], [11]])
    want = jax.jit(llada.attention_exact)(q, k, v, valid)
    got = jax.jit(llada.attention_by_heads)(q, k, v, valid)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("start", [0, 5, 31, 32, 40, 70, 90])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("t", [20, 40, 96])
def test_int8_cache_write_through_whole_tiles_equals_the_slice_write(start, masked, t):
    """``llada._put_tree_tiled`` (an int8 cache's block write on a TPU: the rows merged into a window of
    whole 32-position tiles) writes what the slice write does, at aligned and unaligned starts, near the end
    (a start past L - T clamps as dynamic_update_slice does), for T below, above and equal to the tile count's
    positions (L), and with rows kept where ``keep`` is False (per batch row or per position)."""
    n, b, kv, length, hd = 2, 3, 2, 96, 8
    ks = jax.random.split(jax.random.PRNGKey(start), 5)
    cache = (_kv(ks[0], (n, b, kv, length, hd), True), _kv(ks[1], (n, b, kv, length, hd), True))
    new = kv_quant.stored_like(cache, (jax.random.normal(ks[2], (b, kv, t, hd)),
                                       jax.random.normal(ks[3], (b, kv, t, hd))))
    # (a step's rows: one flag per batch row, [b, 1, 1, 1]; or per position, [b, 1, T, 1])
    keep = None if not masked else jnp.array([True, False, True])[:, None, None, None] if t != 40 else \
        jax.random.bernoulli(ks[4], 0.5, (b, 1, t, 1))
    i, at = jnp.int32(1), jnp.int32(start)
    want = jax.jit(llada._put_tree, static_argnums=4)(cache, new, i, at, 2, keep)
    got = jax.jit(llada._put_tree_tiled, static_argnums=4)(cache, new, i, at, 2, keep)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert not np.array_equal(np.asarray(jax.tree.leaves(want)[0]), np.asarray(jax.tree.leaves(cache)[0]))
