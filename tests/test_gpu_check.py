"""``bench/gpu_check.py``: its ``--smoke`` path in-process (tiny shapes, this CPU: ``pallas`` = the Pallas
interpreter), the time guard, and that the 8B-shaped steps it times on a GPU trace and lower for ``cuda``."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # ``bench`` is a top-level folder of the repo, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from bench import gpu_check as G  # noqa: E402
from polestar_jax import compat  # noqa: E402

# the four step kinds of the check plus the LM head (per-layer columns) and Polestar's block-start pass
SMOKE_ARGS = ["--smoke", "--layers", "1", "--repeats", "2", "--warmup", "1", "--hard-stop-s", "0"]


def test_gpu_check_smoke(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    # with Polestar's hidden-state store offloaded (int8, host memory): the steps move it as the engine does
    # (one refresh width: the interpreted kernels of every width branch would dominate this test's time)
    assert G.main(SMOKE_ARGS + ["--offload-hidden", "int8", "--refresh-buckets", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["config"]["offload_hidden"] == "int8" and data["config"]["refresh_buckets"] == 1

    assert data["benchmark"] == "gpu_check" and data["date"] and data["jax_version"] == jax.__version__
    assert data["device_kind"] == jax.devices()[0].device_kind and data["smoke"] is True
    assert not data["stopped_early"] and data["skipped"] == []
    if jax.default_backend() == "cpu":
        assert data["is_gpu"] is False and "not a GPU" in data["note"] and "NOT A GPU" in printed
        assert set(data["kernels_resolved"]["pallas"].values()) == {"interpret"}
    assert set(data["kernels_resolved"]["reference"].values()) == {"reference"}
    c = data["config"]
    assert (c["layers"], c["d_model"], c["model_layers"], c["peak_hbm_gbs"], c["peak_tflops"]) == (1, 128, 32, 4800, 989)

    rows = {(r["kind"], r["kernels"]): r for r in data["results"]}
    want = {("lm_head", "none"), ("full", "none"), ("polestar_start", "none"), ("dual_step", "none")}
    want |= {(k, m) for k in G.KERNEL_KINDS for m in ("pallas", "reference")}
    assert set(rows) == want
    for (kind, kernels), r in rows.items():
        assert r["status"] == "ok", r
        assert r["ms_median"] > 0 and r["compile_seconds"] > 0 and r["reps"] == 2 and len(r["ms_runs"]) == 2
        assert r["bytes"] > 0 and r["flops"] > 0 and r["achieved_gb_s"] > 0 and r["achieved_tflop_s"] > 0
        assert r["bound"] in ("memory", "compute") and 0 < r["roofline_fraction"] and r["roofline_ms"] > 0
        assert r["bytes"] == r["bytes_model"]["total"]
        if kind != "lm_head":
            pl = r["per_layer"]
            assert pl["head_subtracted"] and pl["bytes"] > 0 and pl["flops"] > 0 and pl["ms"] >= 0
            assert r["est_model_depth_ms"] > 0
            assert r["bytes_model"]["per_layer"]["weights"] > 0 and r["bytes_model"]["per_layer"]["kv"] > 0
            # XLA's count and the matmul formula agree roughly (XLA adds softmax, norms, k-means, ...)
            assert 0.8 < r["flops"] / r["flops_analytic"] < 1.6, (kind, r["flops"], r["flops_analytic"])
    assert rows[("full", "none")]["query_rows"] == c["L"] and rows[("dual_step", "none")]["query_rows"] == c["B"]
    ref, step = rows[("polestar_refresh_step", "reference")], rows[("polestar_step", "reference")]
    assert ref["query_rows"] == c["B"] + c["R"] > step["query_rows"] and ref["head_calls"] == 1
    assert ref["bytes"] > step["bytes"] and ref["flops"] > step["flops"]
    assert set(data["pallas_over_reference"]) == set(G.KERNEL_KINDS)
    assert all(v > 0 for v in data["pallas_over_reference"].values())
    assert "| kind | kernels | ms |" in printed and "polestar_refresh_step" in printed


def test_gpu_check_time_guard(tmp_path):
    """Past the budget nothing more starts; the JSON is written with what there is (here: nothing)."""
    out = tmp_path / "g.json"
    assert G.main(SMOKE_ARGS + ["--budget-s", "0", "--kinds", "lm_head,dual_step", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["stopped_early"] and data["results"] == [] and data["skipped"] == ["lm_head/none", "dual_step/none"]


def test_gpu_check_8b_bytes_model():
    cc = G.CheckConfig(layers=4)
    cfg, model_layers = G.model_config(cc)
    assert (cfg.d_model, cfg.n_heads, cfg.mlp_hidden_size, cfg.embedding_size, cfg.n_layers, model_layers) == (
        4096, 32, 12288, 126464, 4, 32)
    bm = G.bytes_model("dual_step", cfg, cc)
    assert bm["per_layer"]["weights"] == (4 * 4096 * 4096 + 3 * 4096 * 12288 + 2 * 4096) * 2  # 436 MB bf16
    assert bm["per_layer"]["kv"] == 2 * 32 * 512 * 128 * 2 + 2 * 32 * 32 * 128 * 2  # cache read + block rows
    assert bm["total"] == 4 * bm["per_layer_total"] + bm["once_total"]
    assert bm["once"]["lm_head"] >= 4096 * 126464 * 2
    refresh = G.bytes_model("polestar_refresh_step", cfg, cc)
    # block and suffix logits in one GEMM: the head's weights once, the suffix rows' logits besides
    assert 4096 * 126464 * 2 < refresh["once"]["lm_head"] < 2 * 4096 * 126464 * 2
    assert refresh["once"]["lm_head"] > bm["once"]["lm_head"]


@pytest.mark.parametrize("kind", G.KINDS)
def test_gpu_check_8b_shapes_lower_for_cuda(kind):
    """Every kind at the real 8B shapes (1 layer, L 512, block 32) traces, keeps its state's structure (so
    the donated state can be fed back) and, for the Polestar steps with ``pallas``, lowers for cuda with
    Triton kernels: what the H200 run will compile, checked from this CPU."""
    cc = G.CheckConfig(layers=1)
    cfg, _ = G.model_config(cc)
    params = jax.eval_shape(lambda: G.M.init_params(cfg, jax.random.key(0, impl="rbg"), dtype=jnp.bfloat16))
    if kind == "lm_head":
        state = jax.ShapeDtypeStruct((1, cc.block_length, cfg.d_model), jnp.bfloat16)
    else:
        state = jax.eval_shape(lambda: G.make_state(cfg, cc, polestar=kind.startswith("polestar")))
    cs = jax.ShapeDtypeStruct((), jnp.int32)
    for kernels in (G.KERNEL_MODES if kind in G.KERNEL_KINDS else ("none",)):
        fn = G.step_fn(kind, cfg, cc, kernels)
        _, new_state = jax.eval_shape(fn, params, state, cs)
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        assert all(a.shape == b.shape and a.dtype == b.dtype
                   for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)))
        if kernels == "pallas":
            checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
            mlir = compat.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
                params, state, cs).mlir_module()
            assert "__gpu$xla.gpu.triton" in mlir


# ------------------------------------------------------------------------------------------------ Dream
def _qwen2_layer_params(cfg) -> int:
    """Weights of one Qwen2-layout layer: q/k/v/o, the SwiGLU MLP, two norms, the q/k/v biases."""
    d, q, kv, f = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.mlp_hidden_size
    return 2 * d * q + 2 * d * kv + 3 * d * f + 2 * d + q + 2 * kv


def test_gpu_check_smoke_dream(tmp_path, capsys):
    """``--smoke --family dream``: tiny Dream shapes (GQA 4 -> 2, q/k/v biases) with Dream's Polestar window
    (64 rows back, 32 ahead); every kind runs, with the Pallas interpreter and the references."""
    out = tmp_path / "gpu_check_dream.json"
    assert G.main(SMOKE_ARGS + ["--family", "dream", "--refresh-buckets", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    c = data["config"]
    assert c["family"] == "dream" and (c["n_heads"], c["n_kv_heads"], c["model_layers"]) == (4, 2, 28)
    assert (c["prompt_length"], c["B"], c["R"], c["suffix_rows"], c["proxy_heads"]) == (64, 16, 96, 32, 1)
    cfg, _ = G.model_config(G.CheckConfig(layers=1, smoke=True, family="dream"))
    n_params = 2 * cfg.embedding_size * cfg.d_model + cfg.d_model + _qwen2_layer_params(cfg)
    assert data["param_bytes"] == 2 * n_params  # bf16, the biases included
    rows = {(r["kind"], r["kernels"]): r for r in data["results"]}
    assert len(rows) == len(G.KINDS) + len(G.KERNEL_KINDS) and all(r["status"] == "ok" for r in rows.values())
    if jax.default_backend() == "cpu":
        assert set(data["kernels_resolved"]["pallas"].values()) == {"interpret"}
    ref = rows[("polestar_refresh_step", "reference")]
    assert ref["query_rows"] == c["B"] + c["R"] and ref["bytes"] == ref["bytes_model"]["total"]
    assert "dream: 1 of 28 layers" in printed and "4 heads / 2 KV heads" in printed


def test_gpu_check_dream7b_bytes_model():
    """Dream-7B shapes from tests/data/dream7b_config.json: the byte model counts the q/k/v biases, the K/V
    cache of the 4 KV heads (not 28), Dream's 96-row store and its single proxy-attention head."""
    cc = G.CheckConfig(layers=4, family="dream")
    cfg, model_layers = G.model_config(cc)
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden_size, cfg.embedding_size,
            cfg.n_layers, model_layers, cfg.include_qkv_bias) == (3584, 28, 4, 128, 18944, 152064, 4, 28, True)
    bm = G.bytes_model("dual_step", cfg, cc)
    assert bm["per_layer"]["weights"] == _qwen2_layer_params(cfg) * 2  # 466 MB bf16
    assert bm["per_layer"]["kv"] == 2 * 4 * 512 * 128 * 2 + 2 * 4 * 32 * 128 * 2  # cache read + block rows
    assert bm["once"]["lm_head"] >= 3584 * 152064 * 2
    g = G.geometry_numbers(cfg, cc)
    assert (g["R"], g["suffix_rows"], g["proxy_heads"], g["K"]) == (96, 32, 1, 8)
    refresh = G.bytes_model("polestar_refresh_step", cfg, cc)
    assert refresh["per_layer"]["polestar"] == 2 * 96 * 3584 * 2 + 2 * 1 * 8 * 512 * 4
    assert refresh["once"]["drift"] == 2 * 28 * 32 * 512 * 4  # the token drift keeps all 28 query heads
    with pytest.raises(ValueError, match="llada config"):
        G.model_config(G.CheckConfig(family="dream", model_config=G.LLADA_8B_CONFIG))


@pytest.mark.parametrize("kind", ["polestar_start", "polestar_refresh_step"])
def test_gpu_check_dream7b_shapes_lower_for_cuda(kind):
    """Dream-7B-shaped Polestar steps (1 layer, L 512, block 32) trace, keep their state's structure and, with
    ``pallas``, lower for cuda with Triton kernels: what an H200 run of ``--family dream`` compiles."""
    cc = G.CheckConfig(layers=1, family="dream")
    cfg, _ = G.model_config(cc)
    params = jax.eval_shape(lambda: G.init_params(cfg, jax.random.key(0, impl="rbg")))
    assert params["blocks"]["bk"].shape == (1, 512)
    state = jax.eval_shape(lambda: G.make_state(cfg, cc, polestar=True))
    cs = jax.ShapeDtypeStruct((), jnp.int32)
    for kernels in (G.KERNEL_MODES if kind in G.KERNEL_KINDS else ("none",)):
        fn = G.step_fn(kind, cfg, cc, kernels)
        _, new_state = jax.eval_shape(fn, params, state, cs)
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        if kernels == "pallas":
            checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
            mlir = compat.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
                params, state, cs).mlir_module()
            assert "__gpu$xla.gpu.triton" in mlir


def test_gpu_session_smoke(tmp_path):
    """The prepared script for a lent GPU (``bench/gpu_session.py``) runs its steps at tiny sizes on the CPU:
    the step kinds as compiled before the engine's GPU options, and the engine's block programs per step."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "bench.gpu_session", "--smoke", "--steps", "before,blocks",
                           "--budget-s", "400", "--out-dir", str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    session = json.loads((tmp_path / "session.json").read_text())
    assert [s["step"] for s in session["steps"]] == ["before", "blocks"]
    assert all(s["returncode"] == 0 for s in session["steps"]), session["steps"]
    before = json.loads((tmp_path / "gpu_check_before.json").read_text())
    assert before["benchmark"] == "gpu_check" and before["results"] and not before["config"]["engine_options"]
    blocks = json.loads((tmp_path / "block_programs.json").read_text())["rows"]
    assert {(r["decoder"], r["batch"]) for r in blocks} == {("dual", 1), ("dual", 2), ("polestar", 1), ("polestar", 2)}
    assert all(r["ms_per_step"] > 0 and r["forwards"] >= 1 for r in blocks)
