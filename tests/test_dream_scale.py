"""Dream at scale and with Polestar's machinery (issue #17): mixed prompt lengths in one batch, the mesh with
GQA-aware sharding (8 simulated devices, one subprocess), the Dream-7B memory plan, the host offload of the
hidden-state store, and the Pallas kernels (interpreter, cuda / tpu export) on the Dream path.

Model: the golden ``tests/data/dream_tiny_a`` (Qwen2 layout: 2 layers, hidden 64, 4 query heads sharing 2 KV
heads, q/k/v biases), whose cases the official Dream code decoded one prompt at a time, unpadded.

Dream-7B shapes: ``tests/data/dream7b_config.json``. Where its values come from (DREAM_SPEC §0, the public
Dream-v0-Instruct-7B ``config.json`` as that section lists it): hidden 3584, 28 layers, 28 query heads, 4 KV
heads, intermediate 18944, vocab 152064, RoPE theta 1e6, RMSNorm eps 1e-6, untied LM head, q/k/v biases.
The section notes that these are the Qwen2.5-7B values Dream-7B was initialised from (no verbatim copy of
Dream's own file was at hand); the other Qwen2 keys of the file (``max_position_embeddings`` 131072,
``max_window_layers`` 28, no sliding window) are Qwen2.5-7B's and have no effect on this code. The ids are
DreamConfig's defaults (mask 151666, pad 151643) with bos = eos = 151643 from Dream's generation config.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax import crosscheck as CC
from polestar_jax.config import DecodeConfig, ModelConfig
from engines import generate  # tests/engines.py
from polestar_jax.models.family import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
DREAM_DIR = DATA / "dream_tiny_a"
DREAM_7B = DATA / "dream7b_config.json"
SLOT = 80  # one prompt slot for the g64 golden prompts (12 to 70 tokens): every row is left-padded
_TRITON = "__gpu$xla.gpu.triton"


@pytest.fixture(scope="module")
def cases(dream_cases) -> list:
    return dream_cases["generate_cases"]


def _golden(cases: list, method: str, tag: str = "g64_b16_s64") -> list:
    return [c for c in cases if c["name"].startswith(method + "/") and c["name"].endswith(tag)]


def _polestar(**kw) -> DecodeConfig:
    """Dream's Polestar as a user gets it: the family's parameters (its windows, proxy score, K/V patch, tie
    rule), the default Polestar-Commit (early and suffix commits on)."""
    return DecodeConfig(decoder="polestar", gen_length=64, block_length=16, threshold=0.9,
                        polestar=FAMILIES["dream"].polestar_config(**kw))


@pytest.fixture(scope="module")
def polestar_batch(dream, cases):
    """(prompts, result): Dream Polestar (the jnp references, one refresh width) on a batch of a 12- and a
    40-token prompt in a 48-token slot, seed 3, job rows 5 and 9 (shared by the tests below: one compile)."""
    cfg, params = dream
    prompts = [c["prompt_ids"] for c in _golden(cases, "polestar")[:2]]
    assert [len(p) for p in prompts] == [12, 40]
    dc = _polestar(kernels="reference", refresh_buckets=1)
    return prompts, generate(params, cfg, prompts, dc, seed=3, rows=[5, 9], prompt_slot=48)


def _same_rows(a, ra: int, b, rb: int) -> None:
    """Row ``ra`` of result ``a`` and row ``rb`` of ``b``: tokens, commit steps, NFE (per block) and the
    Polestar statistics (block_stats, early and suffix commits) all equal."""
    np.testing.assert_array_equal(a.tokens[ra], b.tokens[rb])
    np.testing.assert_array_equal(a.commit_step[ra], b.commit_step[rb])
    np.testing.assert_array_equal(a.block_nfe[ra], b.block_nfe[rb])
    assert a.block_stats(ra) == b.block_stats(rb)
    if a.polestar is not None:
        for key in ("early", "suffix"):
            assert int(a.polestar[key][ra]) == int(b.polestar[key][rb]), key


# ------------------------------------------------------------------------------- mixed prompt lengths
@pytest.mark.parametrize("method", ["plain_thr", "dual_nocluster_thr", "dual_nocluster_sched"])
def test_golden_sampler_cases_in_one_mixed_length_batch(dream, cases, method):
    """The three g64 golden cases of a Dream sampler (prompts of different lengths) decoded as ONE batch, each
    row left-padded into an 80-token slot: every row's ids, NFE and the commits of every forward equal the
    official code's unpadded batch-1 run. So the key mask hides the padding, a row's RoPE positions start at
    its first real token, and the logit shift (position p from row p-1 of the forward's span) reads the
    right row of a padded row."""
    cfg, params = dream
    chunk = _golden(cases, method)
    assert len(chunk) == 3 and len({len(c["prompt_ids"]) for c in chunk}) == 3
    dcfg = CC.dream_decode_config(chunk[0])
    res = generate(params, cfg, [c["prompt_ids"] for c in chunk], dcfg, prompt_slot=SLOT)
    for r, c in enumerate(chunk):
        got = CC._check_generation(c["name"], res, r, len(c["prompt_ids"]), c["generated_ids"], c["nfe"],
                                   c["trajectory"], c["margins"]["commits_per_forward"], exact_trajectory=True)
        assert got.status == "pass", f"{c['name']}: {got.detail}"


def test_golden_polestar_cases_in_one_mixed_length_batch(dream, cases):
    """The three g64 Polestar golden cases (12, 40 and 25 prompt tokens) as one padded batch, the official
    k-means draws / labels / cluster choices injected per row: ids, NFE, the commits of every forward and the
    block statistics of every row equal the official batch-1 runs."""
    cfg, params = dream
    chunk = _golden(cases, "polestar")
    assert len(chunk) == 3
    dcfg = CC.dream_decode_config(chunk[0], kernels="reference", refresh_buckets=1)
    replay = CC.dream_replay(str(DREAM_DIR), chunk, cfg, dcfg)
    res = generate(params, cfg, [c["prompt_ids"] for c in chunk], dcfg, prompt_slot=SLOT, replay=replay)
    for r, c in enumerate(chunk):
        got = CC._check_dream_polestar_case(c, res, r)
        assert got.status == "pass", f"{c['name']}: {got.detail}"


def test_polestar_rows_equal_alone_with_own_decisions(dream, polestar_batch):
    """Dream Polestar with its own k-means draws (no replay): each row of the mixed-length batch gets exactly
    what it gets alone (its job row keys its draws): tokens, commit steps, NFE per block, block statistics,
    early and suffix commits. (Padding itself: the golden batches above, against unpadded official runs.)"""
    cfg, params = dream
    prompts, both = polestar_batch
    assert (both.tokens != cfg.mask_token_id).all()
    assert int(both.polestar["refresh_steps"].sum()) > 0  # the refresh path ran
    assert int(both.polestar["early"].sum()) + int(both.polestar["suffix"].sum()) > 0  # and Polestar-Commit
    dc = _polestar(kernels="reference", refresh_buckets=1)
    for row, (p, r) in enumerate(zip(prompts, (5, 9))):
        _same_rows(both, row, generate(params, cfg, [p], dc, seed=3, rows=[r], prompt_slot=48), 0)


# ----------------------------------------------------------------------------------------- the mesh
_MESH_SCRIPT = r"""
import json, sys
import jax
import jax.numpy as jnp
import numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
assert len(jax.devices()) == 8, jax.devices()
from polestar_jax import crosscheck as CC, sharding
from polestar_jax.io.checkpoint import load_model, param_shapes
from polestar_jax.config import DecodeConfig, ModelConfig
import os as _os, sys as _sys  # tests/engines.py: the folder above the data folder argv[1]
_p = _os.path.abspath(_sys.argv[1])
while not _os.path.exists(_os.path.join(_p, "engines.py")):
    _p = _os.path.dirname(_p)
_sys.path.insert(0, _p)
from engines import generate  # noqa: E402
from polestar_jax.models.family import FAMILIES
from polestar_jax.decode.layout import init_decode_state

dream_dir, cfg7_path = sys.argv[1], sys.argv[2]
out = {}
split = lambda sh: [i for i, a in enumerate(sh.spec) if a == "model"]  # dims split over "model"
HEADS = ("wq", "bq", "wo", "wk", "wv", "bk", "bv")

# 1. specs at Dream-7B shapes (abstract arrays: no weights): parameters and the Polestar decode state
cfg7 = ModelConfig.from_json(cfg7_path)
abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), param_shapes(cfg7),
                        is_leaf=lambda x: isinstance(x, tuple))
dc7 = DecodeConfig(decoder="polestar", gen_length=64, block_length=32, polestar=FAMILIES["dream"].polestar_config())
state7 = init_decode_state(cfg7, dc7, [[0] * 64] * 2, 64, dtype=jnp.bfloat16, abstract=True)
for m in (2, 4, 7, 8):
    mesh = sharding.make_mesh({"data": 1, "model": m})
    ps = sharding.param_shardings(abstract, mesh, cfg7)
    row = {n: split(ps["blocks"][n]) for n in HEADS + ("w_gate", "w_down")}
    row.update(lm_head=split(ps["lm_head"]), wte=split(ps["wte"]))
    ss = sharding.state_shardings(state7, mesh)
    row.update(k_cache=split(ss.k_cache), p_prev=split(ss.policy_state.p_prev), s_prev=split(ss.policy_state.s_prev))
    out["specs7b/model=%d" % m] = row

# 2. tokens on the mesh against one device: the tiny Dream (4 query heads, 2 KV heads), Dream's samplers
cfg, params = load_model(dream_dir, dtype="float32")
cases = json.load(open(dream_dir + "/cases.json"))["generate_cases"]
gold = [c for c in cases if c["name"].startswith("polestar/") and c["name"].endswith("g64_b16_s64")]
prompts = [c["prompt_ids"] for c in gold[:2]]
common = dict(gen_length=64, block_length=16, threshold=0.9)
dcs = {"dual": DecodeConfig(decoder="fastdllm", cache="dual", step_after_full_pass=False, start_commit="first",
                            **common)}  # (Dream's dual-cache loop; the no-cache sampler runs the same layers)
one = {k: generate(params, cfg, prompts, dc, seed=7, rows=[1, 2], prompt_slot=48) for k, dc in dcs.items()}
MESHES = ("data=2,model=4", "data=2,model=2")  # KV heads 2 < 4: replicated; 2 of 2: split
for spec in MESHES:
    mesh = sharding.make_mesh(spec)
    ps = sharding.param_shardings(params, mesh, cfg)
    out["specs_tiny/" + spec] = {n: split(ps["blocks"][n]) for n in HEADS}
    for name, dc in dcs.items():
        a, b = one[name], generate(params, cfg, prompts, dc, seed=7, rows=[1, 2], prompt_slot=48, mesh=mesh)
        out["tokens/%s/%s" % (spec, name)] = bool((a.tokens == b.tokens).all() and (a.nfe == b.nfe).all()
                                                 and (a.commit_step == b.commit_step).all())

# 3. Polestar with the official decisions injected: the three g64 golden cases as one batch, on each mesh
dcg = CC.dream_decode_config(gold[0], kernels="reference", refresh_buckets=1)
for spec in MESHES:
    res = generate(params, cfg, [c["prompt_ids"] for c in gold], dcg, prompt_slot=80,
                   replay=CC.dream_replay(dream_dir, gold, cfg, dcg), mesh=sharding.make_mesh(spec))
    out["golden/" + spec] = [c["name"] + ": " + r.detail for c, r in
                             ((c, CC._check_dream_polestar_case(c, res, i)) for i, c in enumerate(gold))
                             if r.status != "pass"]

# 4. Polestar with its own draws (k-means and selections computed): whole generations on each mesh against
# one device -- tokens, commit steps, NFE and the Polestar counters equal
dcp = DecodeConfig(decoder="polestar", polestar=FAMILIES["dream"].polestar_config(refresh_buckets=1), **common)
own = generate(params, cfg, prompts, dcp, seed=7, rows=[1, 2], prompt_slot=48)
out["own/refreshed"] = int(own.polestar["refresh_steps"].sum())
for spec in MESHES:
    res = generate(params, cfg, prompts, dcp, seed=7, rows=[1, 2], prompt_slot=48, mesh=sharding.make_mesh(spec))
    out["own/" + spec] = {"tokens": bool((own.tokens == res.tokens).all()), "nfe": bool((own.nfe == res.nfe).all()),
                          "commit_step": bool((own.commit_step == res.commit_step).all()),
                          "counters": {k: bool((np.asarray(v) == np.asarray(res.polestar[k])).all())
                                       for k, v in own.polestar.items()}}
print("RESULT " + json.dumps(out))
"""


def test_mesh_gqa_sharding_and_tokens_on_8_devices():
    """One subprocess with 8 simulated CPU devices.

    Specs at Dream-7B shapes (28 query heads, 4 KV heads): the query side splits over ``model`` only where
    the axis size divides 28, the key/value side (weights, biases, K/V cache) only where it divides 4, the
    rest is replicated, so no device ever holds part of a head; the MLP and the vocabulary split wherever
    they divide; Dream's head-averaged proxy attention (one "head") is never split. On ``data=2,model=4``
    (KV heads 2 < 4: replicated, query heads split) and ``data=2,model=2`` (both split): Dream's dual-cache
    sampler gives the tokens, commit steps and NFE of one device; Polestar with the official decisions injected
    replays the three g64 golden cases exactly (batched); Polestar with its own draws gives the tokens, commit
    steps, NFE and counters of one device. (On ``model=2`` its clusters of identical rows score within 2e-5 of
    each other, split differently from one device: the tie rule of ``polestar_step.tie_groups`` keeps them
    tied, docs/differences.md#d3.)"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(DREAM_DIR), str(DREAM_7B)], capture_output=True,
                          text=True, env=env, cwd=str(ROOT), timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])

    cfg7 = ModelConfig.from_json(str(DREAM_7B))
    for m in (2, 4, 7, 8):
        got = out[f"specs7b/model={m}"]
        q = cfg7.n_heads % m == 0  # whole query heads per device
        kv = cfg7.n_kv_heads % m == 0  # whole KV heads per device
        want = {"wq": [2] if q else [], "bq": [1] if q else [], "wo": [1] if q else [],
                "wk": [2] if kv else [], "wv": [2] if kv else [], "bk": [1] if kv else [], "bv": [1] if kv else [],
                "w_gate": [2] if cfg7.mlp_hidden_size % m == 0 else [],
                "w_down": [1] if cfg7.mlp_hidden_size % m == 0 else [],
                "lm_head": [1] if cfg7.embedding_size % m == 0 else [], "wte": [1] if cfg7.d_model % m == 0 else [],
                "k_cache": [2] if kv else [], "p_prev": [1] if q else [], "s_prev": []}
        assert got == want, (m, got, want)
    assert out["specs7b/model=8"]["wq"] == [] and out["specs7b/model=4"]["wk"] == [2]  # the two regimes occur
    assert out["specs_tiny/data=2,model=4"] == {"wq": [2], "bq": [1], "wo": [1], "wk": [], "wv": [], "bk": [],
                                                "bv": []}
    assert out["specs_tiny/data=2,model=2"] == {"wq": [2], "bq": [1], "wo": [1], "wk": [2], "wv": [2], "bk": [1],
                                                "bv": [1]}
    tokens = {k: v for k, v in out.items() if k.startswith("tokens/")}
    assert len(tokens) == 2 and all(tokens.values()), tokens
    for spec in ("data=2,model=4", "data=2,model=2"):
        assert out[f"golden/{spec}"] == [], spec
        own = out[f"own/{spec}"]
        assert own["tokens"] and own["nfe"] and own["commit_step"] and all(own["counters"].values()), (spec, own)
    assert out["own/refreshed"] > 0  # the generations refreshed


# ---------------------------------------------------------------------------------- memory planning
def _param_count(cfg: ModelConfig) -> int:
    """Parameters of a Qwen2-layout model from its shapes: embedding and untied head, the final norm, and
    per layer q/k/v/o, the SwiGLU MLP, two norms and the q/k/v biases (no o_proj / MLP bias)."""
    d, f, v, n = cfg.d_model, cfg.mlp_hidden_size, cfg.vocab_size, cfg.n_layers
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d + q + 2 * kv
    return 2 * v * d + d + n * per_layer


def test_dream7b_config_and_memory_plan(capsys):
    """The Dream-7B config reads as Dream with the listed shapes; the plan's numbers equal an independent
    count: parameter bytes from the shapes, the K/V cache with the 4 KV heads (a seventh of 28 heads), the
    store of Dream's 64 + 32 window rows, the rest of Polestar's state (one proxy-attention head) and the
    whole decode state; ``--dry-run`` prints them for the config alone and compiles the block step."""
    from polestar_jax.generate import main
    from polestar_jax.engine.plan import plan

    cfg = ModelConfig.from_json(str(DREAM_7B))
    assert cfg.family == "dream" and cfg.include_qkv_bias
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden_size,
            cfg.vocab_size, cfg.embedding_size) == (3584, 28, 28, 4, 128, 18944, 152064, 152064)
    assert (cfg.rope_theta, cfg.rms_norm_eps) == (1e6, 1e-6)
    assert (cfg.mask_token_id, cfg.pad_token_id, cfg.eos_token_id) == (151666, 151643, 151643)
    n = _param_count(cfg)
    assert 7.6e9 < n < 7.7e9  # "7B": 7.6 billion parameters

    b, prompt, gen, blk = 2, 256, 256, 32
    length, nb = prompt + gen, gen // blk
    pc = FAMILIES["dream"].polestar_config()
    mp = plan(cfg, DecodeConfig(decoder="polestar", gen_length=gen, block_length=blk, polestar=pc), batch=b,
              prompt_len=prompt, dtype="bfloat16", compile_step=False)
    assert mp.param_bytes == 2 * n
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * length * cfg.head_dim * 2  # K and V, bf16
    assert mp.kv_bytes_per_seq == kv == 28 * 2 ** 20  # 28 MiB (LLaDA-8B's 32 full heads: 256 MiB at this L)
    rows = 64 + 32  # Dream's full-pass window (its windowed pass, 2B + B, is no larger at B = 32)
    assert mp.hs_bytes_per_seq == cfg.n_layers * rows * (cfg.d_model * 2 + 4)  # bf16 rows + f32 int8 scales
    k, hist = pc.n_clusters, pc.history
    other = (cfg.n_layers * (rows * 4 + k * cfg.d_model * 2 + k * 4 + 4 + 1 * k * length * 4)  # labels,
             # centroids (bf16), counts, n_clusters, s_prev with ONE proxy head ("mean")
             + cfg.n_heads * blk * length * 4 + hist * blk * 4 + 5 * 4 + 3 * nb * 4 + nb)  # p_prev, history,
    # hist_fill / counter / last_commits / early / suffix, per-block statistics, processed
    assert mp.polestar_other_bytes_per_seq == other
    # x, commit_step, pos; key_valid; rng; nfe; block_nfe; block, n_blocks (per-row progress); stop (early exit)
    common = 3 * length * 4 + length + 2 * 4 + 4 + nb * 4 + 2 * 4 + 1
    assert mp.state_bytes == b * (kv + mp.hs_bytes_per_seq + other + common)

    rc = main(["--dry-run", "--model-config", str(DREAM_7B), "--gen-length", "64", "--block-length", "32",
               "--decoder", "fastdllm", "--dtype", "float32"])
    assert rc == 0
    text = capsys.readouterr().out
    assert f"parameters: {4 * n / 2 ** 30:.3f} GiB ({4 * n:,} bytes)" in text
    kv32 = 2 * cfg.n_layers * cfg.n_kv_heads * (128 + 64) * cfg.head_dim * 4
    assert f"KV cache per sequence: {kv32 / 2 ** 30:.3f} GiB" in text and "compiled block step" in text


# ---------------------------------------------------------------------------------- host offload
def test_int8_offload_rows_do_not_leak(dream, cases):
    """The int8 store (host memory where the backend has it) on Dream: every token committed, the refresh
    ran (its store reads and writes), and each row of a mixed-length batch gets what it gets beside a copy
    of itself: the other row's prompt and store never leak into it. (int8 is lossy by design: how far it
    moves tokens is a benchmark question, as for LLaDA.)

    The reference is a batch of the same shape, not the row alone: XLA's CPU matmuls are not bitwise
    invariant to the batch size on every processor (on an AMD EPYC host the float32 token drift of a row
    differed by ~3e-6 between batch 2 and batch 1), and the int8 rounding can turn such a difference into a
    changed token (one token of 64 there), which says nothing about the rows' independence."""
    cfg, params = dream
    dc = _polestar(offload_hidden="int8", refresh_buckets=1)  # (widths do not change tokens: test_refresh.py)
    prompts = [c["prompt_ids"] for c in _golden(cases, "polestar")[:2]]
    both = generate(params, cfg, prompts, dc, seed=11, rows=[0, 1], prompt_slot=48)
    assert (both.tokens != cfg.mask_token_id).all()
    assert int(both.polestar["refresh_steps"].sum()) > 0
    for row, p in enumerate(prompts):
        pair = generate(params, cfg, [p, p], dc, seed=11, rows=[row, row], prompt_slot=48)
        for r in (0, 1):
            _same_rows(both, row, pair, r)


def test_bf16_offload_is_exact_on_bf16_weights(dream, cases):
    """With bf16 weights the bf16 store encodes nothing (the rows are bf16 already), so moving it to host
    memory and reading back only the refreshed rows must not change anything: tokens, commit steps, NFE and
    Polestar statistics equal the exact device store's."""
    cfg, params = dream
    params16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    prompts = [c["prompt_ids"] for c in _golden(cases, "polestar")[:2]]
    res = {m: generate(params16, cfg, prompts, _polestar(offload_hidden=m, refresh_buckets=1), seed=2,
                       prompt_slot=48) for m in ("none", "bf16")}
    assert int(res["none"].polestar["refresh_steps"].sum()) > 0
    for row in range(2):
        _same_rows(res["none"], row, res["bf16"], row)


# ------------------------------------------------------------------------------------------ kernels
def test_interpret_kernels_decode_as_reference_on_dream(dream, polestar_batch):
    """Dream Polestar (GQA: 4 query heads on 2 KV heads; head-averaged proxy attention; clustered K/V
    patch) with the Pallas kernels in the interpreter decodes the mixed-length batch exactly as with the jnp
    references: tokens, commit steps, NFE, Polestar statistics. (One refresh width: every kernel still
    runs; widths do not change tokens, tests/test_refresh.py.)"""
    cfg, params = dream
    prompts, ref = polestar_batch
    assert int(ref.polestar["refresh_steps"].sum()) > 0
    got = generate(params, cfg, prompts, _polestar(kernels="interpret", refresh_buckets=1), seed=3, rows=[5, 9],
                   prompt_slot=48)
    for row in range(2):
        _same_rows(ref, row, got, row)


@pytest.mark.parametrize("flavor", ["triton", "mosaic"])
def test_cluster_drift_kernel_on_dreams_proxy_inputs(dream, flavor):
    """The cluster-drift kernel on Dream's proxy inputs (queries averaged over the 4 heads, keys over the 2
    KV heads: one "head" each), a length no block divides and a left-padded row, in the interpreter: equal
    to its jnp reference, whose probabilities are ``drift.proxy_attention(mode="mean")``, the function the
    block start stores."""
    from polestar_jax.decode.polestar import drift as Dr
    from polestar_jax.kernels import kl_drift as KD

    cfg, params = dream
    lp = jax.tree.map(lambda a: a[1], params["blocks"])
    rng = np.random.default_rng(0)
    b, k, length = 2, 8, 37
    cent = jnp.asarray(rng.standard_normal((b, k, cfg.d_model)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((b, cfg.n_kv_heads, length, cfg.head_dim)), jnp.float32)
    valid = np.ones((b, length), bool)
    valid[1, :9] = False  # left padding
    valid = jnp.asarray(valid)
    prev = rng.random((b, 1, k, length)).astype(np.float32)
    prev = jnp.asarray(prev / prev.sum(-1, keepdims=True))

    @jax.jit
    def run(cent, keys, valid, prev):
        qc, kc = Dr.proxy_inputs(lp, cent, keys, cfg, "mean")
        assert qc.shape == (b, 1, k, cfg.head_dim) and kc.shape == (b, 1, length, cfg.head_dim)
        got = KD.kl_drift(qc, kc, valid, prev, mode="cluster", interpret=True, flavor=flavor)
        return got, KD.kl_drift_reference(qc, kc, valid, prev, mode="cluster"), Dr.proxy_attention(
            lp, cent, keys, cfg, valid, mode="mean")

    (d, p), (d_ref, p_ref), s = run(cent, keys, valid, prev)
    assert d.shape == (b, k) and p.shape == (b, 1, k, length)
    np.testing.assert_allclose(np.asarray(p), np.asarray(p_ref), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(d), np.asarray(d_ref), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(p_ref), np.asarray(s), rtol=1e-6, atol=1e-8)
    assert float(np.asarray(p)[1, 0, :, :9].max()) == 0.0  # padded keys get no probability


@pytest.mark.parametrize("platform,offload", [("cuda", "int8"), ("tpu", "none")])
def test_dream_polestar_block_exports_with_kernels(dream, platform, offload):
    """Dream's whole Polestar block (GQA, the family's parameters, ``kernels="auto"``) exported for cuda and
    tpu from this CPU: the Pallas kernels lower into it (Triton / Mosaic custom calls), and with the int8
    store it lives in pinned host memory."""
    from polestar_jax import compat
    from polestar_jax.decode.block import EngineSpec, Knobs, decode_block
    from polestar_jax.decode.layout import init_decode_state

    cfg, params = dream
    dc = _polestar(offload_hidden=offload)
    state = init_decode_state(cfg, dc, [[1] * 12, [2] * 40], 48, abstract=True)
    knobs = jax.eval_shape(lambda: Knobs.from_config(dc))
    exp = compat.export(jax.jit(decode_block, static_argnames=("spec",)), platforms=[platform],
                        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON)])(
        jax.eval_shape(lambda: params), state, knobs, None,
        spec=EngineSpec.from_config(cfg, dc))
    text = exp.mlir_module()
    assert "while" in text
    assert (f"custom_call @{_TRITON}" if platform == "cuda" else "tpu_custom_call") in text
    if offload != "none":
        assert 'mhlo.memory_kind = "pinned_host"' in text
