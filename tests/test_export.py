"""Lowering for GPU and TPU without the hardware: ``jax.export`` of the kernels for ``cuda`` and ``tpu``.

``jax.export`` runs the whole lowering (for Pallas: the Triton / Mosaic kernel IR, built in Python and
embedded in a custom call) but compiles nothing, so a change that breaks a kernel's lowering fails here on
a CPU-only machine. What it cannot check: the Triton -> PTX and Mosaic compilers themselves (they run in
XLA at compile time on the device), nor numerics on the device.

The backend table (``polestar_jax.kernels.backend.SUPPORTED``) is checked both ways: every listed
(kernel, platform) pair exports with the Pallas custom call under ``backend="auto"``; every pair *not*
listed (e.g. ``rocm``, where the Triton flavour is untested) must export the plain-jnp reference instead.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from polestar_jax import compat
from polestar_jax.kernels import backend as BK
from polestar_jax.kernels import kl_drift as KD
from polestar_jax.kernels import refresh as RF

S = jax.ShapeDtypeStruct
_TRITON = "__gpu$xla.gpu.triton"
_MARKERS = {"cuda": _TRITON, "rocm": _TRITON, "tpu": "tpu_custom_call"}
_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(_TRITON)]  # Triton calls carry no compatibility promise


def _export(f, args, platform):
    return compat.export(jax.jit(f), platforms=[platform], disabled_checks=_CHECKS)(*args).mlir_module()


def _has_kernel(text, platform):
    return f"custom_call @{_MARKERS.get(platform, '__none__')}" in text or (
        platform == "tpu" and "tpu_custom_call" in text)


# LLaDA-like shapes: block of 32 tokens, L = 1000 (no multiple of any block size), hd = 128, GQA 8 -> 2
b, H, KV, T, L, HD, NCL, R, D = 2, 8, 2, 32, 1000, 128, 8, 96, 512
_I, _B, _F, _BF = jnp.int32, jnp.bool_, jnp.float32, jnp.bfloat16

CASES = {
    "kl_drift_token": ("kl_drift", functools.partial(KD.kl_drift, mode="token"),
                       (S((b, H, T, HD), _BF), S((b, KV, L, HD), _BF), S((b, L), _B), S((b, H, T, L), _F))),
    "kl_drift_cluster": ("kl_drift", functools.partial(KD.kl_drift, mode="cluster"),
                         (S((b, H, NCL, HD), _F), S((b, KV, L, HD), _F), S((b, L), _B), S((b, H, NCL, L), _F))),
    "gather_rows_int8": ("gather_rows", functools.partial(RF.gather_rows, dtype=_BF),
                         (S((b, R, D), jnp.int8), S((b, R), _I), S((b, R), _B), S((b, R), _F))),
    "gather_rows_bf16": ("gather_rows", RF.gather_rows, (S((b, R, D), _BF), S((b, R), _I), S((b, R), _B))),
    "scatter_rows": ("scatter_rows", RF.scatter_rows,
                     (S((b, L, D), _BF), S((b, R, D), _BF), S((b, R), _I), S((b, R), _B))),
    "scatter_kv_rows": ("scatter_rows", RF.scatter_kv_rows,
                        (S((b, KV, L, HD), _BF), S((b, KV, R, HD), _BF), S((b, R), _I), S((b, R), _B))),
    "scatter_rows_f32": ("scatter_rows", RF.scatter_rows,
                         (S((b, L, D), _F), S((b, R, D), _F), S((b, R), _I), S((b, R), _B))),
    "scatter_kv_rows_f32": ("scatter_rows", RF.scatter_kv_rows,
                            (S((b, KV, L, HD), _F), S((b, KV, R, HD), _F), S((b, R), _I), S((b, R), _B))),
    "centroid_shift": ("centroid_shift", RF.centroid_shift,
                       (S((b, NCL, D), _BF), S((b, R), _I), S((b, NCL), _F), S((b, R), _B), S((b, R, D), _BF),
                        S((b, R, D), _BF))),
}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_exports(case, platform):
    """backend="auto" lowers the Pallas kernel where the table lists the platform, else the reference."""
    kernel, f, args = CASES[case]
    text = _export(f, args, platform)
    # packed (bf16) rows have no Mosaic scatter: the reference on tpu (kernels.refresh.mosaic_rows_exclude)
    excluded = RF.mosaic_rows_exclude(args[0].dtype) if kernel == "scatter_rows" else frozenset()
    assert excluded == (frozenset({"tpu"}) if kernel == "scatter_rows" and args[0].dtype == _BF else frozenset())
    if platform in BK.SUPPORTED[kernel] - excluded:
        assert _has_kernel(text, platform), f"{case}: no Pallas custom call in the {platform} export"
    else:
        assert not _has_kernel(text, platform), f"{case}: {platform} is not in SUPPORTED but a kernel lowered"


@pytest.mark.parametrize("case", ["kl_drift_token", "scatter_kv_rows"])
def test_unsupported_platform_falls_back_to_reference(case):
    """rocm has no entry in the table (the Triton flavour is unverified there): "auto" must export the
    reference, "pallas" the interpreter; neither contains a kernel custom call."""
    kernel, f, args = CASES[case]
    assert "rocm" not in BK.SUPPORTED[kernel]
    assert BK.resolve_backend("auto", "rocm", kernel=kernel) == "reference"
    text = _export(f, args, "rocm")
    assert _TRITON not in text


def test_table_entry_removed_means_reference(monkeypatch):
    """The fallback is driven by the table: with tpu removed for kl_drift, the tpu export of "auto" is the
    reference (and it lowers). (The table is read at trace time: a fresh function avoids jit's trace cache.)"""
    _, f0, args = CASES["kl_drift_token"]
    f = lambda *a: f0(*a)
    monkeypatch.setitem(BK.SUPPORTED, "kl_drift", frozenset({"cuda"}))
    assert BK.resolve_backend("auto", "tpu", kernel="kl_drift") == "reference"
    assert not _has_kernel(_export(f, args, "tpu"), "tpu")
    assert _has_kernel(_export(f, args, "cuda"), "cuda")


def test_explicit_pallas_backend_exports():
    """backend="pallas" is the same kernel as "auto" on a listed platform."""
    _, _, args = CASES["centroid_shift"]
    for platform in ("cuda", "tpu"):
        text = _export(functools.partial(RF.centroid_shift, backend="pallas"), args, platform)
        assert _has_kernel(text, platform)
    text = _export(functools.partial(RF.centroid_shift, backend="reference"), args, "tpu")
    assert not _has_kernel(text, "tpu")


def test_cpu_export_is_reference():
    _, f, args = CASES["kl_drift_token"]
    text = _export(f, args, "cpu")
    assert "custom_call @" + _TRITON not in text and "tpu_custom_call" not in text


@pytest.fixture(scope="module")
def block_step_args():
    """Abstract params / state / knobs of the tiny Polestar block step (as polestar_jax.engine.plan builds them)."""
    from polestar_jax.models import llada as M
    from polestar_jax.decode.block import EngineSpec, Knobs
    from polestar_jax.config import DecodeConfig, ModelConfig
    from polestar_jax.decode.layout import init_decode_state

    cfg = ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=48, vocab_size=64,
                      embedding_size=64, mask_token_id=63, eos_token_id=62, pad_token_id=62,
                      max_sequence_length=128)
    dcfg = DecodeConfig(decoder="polestar", gen_length=32, block_length=8)
    spec = EngineSpec.from_config(cfg, dcfg)
    batch, plen = 2, 16
    params = jax.eval_shape(lambda: M.init_params(cfg, jax.random.PRNGKey(0), jnp.float32))
    state = init_decode_state(cfg, dcfg, [[0] * plen] * batch, plen, abstract=True)
    knobs = jax.eval_shape(lambda: Knobs.from_config(dcfg))
    return params, state, S((), jnp.int32), knobs, spec


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_polestar_block_step_exports(block_step_args, platform):
    """The whole Polestar block (block-start pass + while-loop of decode steps with refresh) lowers for
    GPU and TPU. It is plain jnp today (no kernel custom call); once polestar.py calls the kernels with
    backend="auto", the same export carries them."""
    from polestar_jax.decode.block import decode_block as run_block

    params, state, block_idx, knobs, spec = block_step_args
    exp = compat.export(jax.jit(run_block, static_argnames=("spec",)), platforms=[platform],
                        disabled_checks=_CHECKS)(params, state, knobs, None, spec=spec)  # (rows carry their block)
    assert exp.platforms == (platform,)
    assert "while" in exp.mlir_module()
