"""Across the supported JAX versions (jax 0.10.2 on Python 3.11 up to the 0.12 series on 3.12 / 3.13):

* a converted folder written by the orbax version installed before the upgrade (committed in
  ``tests/data/orbax_0.12.8/``, see its ``PROVENANCE.json``) still loads, bit-exactly equal to its source
  weights, in float32 and bfloat16;
* the shims of :mod:`polestar_jax.compat` (host compute, lowering for a GPU that is not there);
* every kernel traces for every platform branch at awkward shapes (jax >= 0.12 bounds-checks static ref
  slices at trace time and ``lax.platform_dependent`` traces the Triton branch on CPU too), exports for
  cuda and tpu, and the padded Triton flavour still matches the reference in the interpreter;
* the declared requirements match the oldest version the compat module supports.
"""
from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from polestar_jax import compat
from polestar_jax.io.checkpoint import hf_to_params, is_converted_folder, load_model, read_hf_folder
from polestar_jax.config import ModelConfig
from polestar_jax.kernels import backend as BK
from polestar_jax.kernels import kl_drift as KD
from polestar_jax.kernels import refresh as RF

DATA = Path(__file__).resolve().parent / "data"
SOURCE = DATA / "llada_tiny_a"
OLD_ORBAX = DATA / "orbax_0.12.8"
REPO_ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------ checkpoints of the old orbax
def _leaves(tree, prefix=""):
    for k, v in sorted(tree.items()):
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name, dtype", [("llada_tiny_a_f32", np.float32), ("llada_tiny_a_bf16", ml_dtypes.bfloat16)])
def test_old_orbax_checkpoint_loads_bit_exact(name, dtype):
    """The committed folder, written by ``python -m polestar_jax.convert`` with orbax-checkpoint 0.12.8 /
    jax 0.10.2, restores (keeping its dtype) to exactly the source safetensors weights (bfloat16: the same
    round-to-nearest-even cast the converter applies), and loading leaves the folder untouched."""
    folder = OLD_ORBAX / name
    assert is_converted_folder(folder)
    before = _listing(folder)
    cfg, params = load_model(folder)
    src_cfg = ModelConfig.from_json(SOURCE / "config.json")
    assert cfg == src_cfg
    want = dict(_leaves(hf_to_params(read_hf_folder(SOURCE), src_cfg, dtype=np.dtype(dtype))))
    got = dict(_leaves(params))
    assert sorted(got) == sorted(want) and len(got) == 12
    for key, w in want.items():
        g = np.asarray(got[key])
        assert g.dtype == np.dtype(dtype) and g.shape == w.shape, key
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=key)
    assert _listing(folder) == before  # restoring wrote nothing into the committed test data


def test_old_orbax_checkpoint_cast_on_load_and_provenance():
    """``load_model(dtype=...)`` of the old bf16 folder widens exactly; PROVENANCE.json says what wrote it."""
    _, p32 = load_model(OLD_ORBAX / "llada_tiny_a_bf16", dtype="float32")
    _, p16 = load_model(OLD_ORBAX / "llada_tiny_a_bf16")
    for (k, a), (_, b) in zip(_leaves(p32), _leaves(p16)):
        assert a.dtype == jnp.float32, k
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(np.float32), err_msg=k)
    prov = json.loads((OLD_ORBAX / "PROVENANCE.json").read_text())
    assert prov["versions"]["orbax-checkpoint"] == "0.12.8" and prov["versions"]["jax"] == "0.10.2"
    assert set(prov["folders"]) == {"llada_tiny_a_f32", "llada_tiny_a_bf16"}
    total = sum(sum(_listing(OLD_ORBAX / f).values()) for f in prov["folders"])
    assert total < 1_000_000  # small enough to keep in the repository


# ------------------------------------------------------------------------------------------------ shims
def test_parse_version():
    assert compat.parse_version("0.12.0.1") == (0, 12, 0, 1)
    assert compat.parse_version("0.10.2") == (0, 10, 2)
    assert compat.parse_version("0.13.0rc1") == (0, 13, 0)
    assert compat.parse_version("0.12.1.dev20261101+cuda12") == (0, 12, 1)
    assert compat.JAX_VERSION >= compat.MIN_JAX


def test_compute_on_api_detected():
    """The signature switch is detected from the installed API (0.12 made the arguments keyword-only)."""
    import inspect

    from jax.experimental.compute_on import compute_on

    params = inspect.signature(compute_on).parameters
    assert compat.COMPUTE_ON_KEYWORD_ONLY == ("out_memory_spaces" in params)
    if compat.JAX_VERSION < (0, 11):
        assert not compat.COMPUTE_ON_KEYWORD_ONLY
    if compat.JAX_VERSION >= (0, 12):
        assert compat.COMPUTE_ON_KEYWORD_ONLY


def test_compute_on_host_runs_on_the_host():
    """A jitted gather decorated with compute_on_host, called on a host-placed array inside jit (as
    polestar_jax.decode.polestar.offload does): the right rows, computed in a ``_xla_compute_type = "host"`` call."""
    from polestar_jax.decode.polestar import offload as OF

    if not OF.host_memory_available():
        pytest.skip("this backend has no pinned_host memory")

    @compat.compute_on_host
    @jax.jit
    def take(x, i):
        return jnp.take(x, i, axis=0, mode="clip")

    @jax.jit
    def f(x, i):
        xh = jax.device_put(x, jax.memory.Space.Host)
        ih = jax.device_put(i, jax.memory.Space.Host)
        return jax.device_put(take(xh, ih), jax.memory.Space.Device)

    x = jnp.arange(24, dtype=jnp.float32).reshape(6, 4)
    i = jnp.array([4, 0, 5], jnp.int32)
    np.testing.assert_array_equal(np.asarray(f(x, i)), np.asarray(x)[[4, 0, 5]])
    assert '_xla_compute_type = "host"' in f.lower(x, i).as_text()


def test_lowering_target_only_when_needed():
    """No abstract device for tpu / cpu exports or where a GPU is present; for cuda without one, an
    abstract mesh that names the GPU (read by the Triton lowering of jax >= 0.12)."""
    current = lambda: jax.sharding.get_abstract_mesh().abstract_device
    for platform in ("tpu", "cpu"):
        with compat.lowering_target(platform):
            assert current() is None
    with compat.lowering_target("cuda"):
        dev = current()
        if compat._has_local_gpu():
            assert dev is None
        else:
            assert dev.device_kind == compat.ABSTRACT_GPU_KIND and dev.platform == "gpu"
    assert current() is None


def test_versions_line():
    v = compat.versions()
    assert v["jax"] == jax.__version__ and v["python"] == ".".join(map(str, sys.version_info[:3]))
    assert v["orbax-checkpoint"] != "-" and v["flax"] != "-"
    assert compat.version_line().startswith(f"python {v['python']}, jax {jax.__version__}")


def test_requirements_match_compat():
    """pyproject: no upper cap on jax or Python; the jax floor is compat.MIN_JAX."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    m = re.search(r'^requires-python = "([^"]+)"', text, re.M)
    assert m and m.group(1) == ">=3.11", m and m.group(1)
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S).group(1)
    jax_dep = re.search(r'"jax([^"]*)"', deps).group(1)
    assert jax_dep == ">=" + ".".join(map(str, compat.MIN_JAX)), jax_dep
    assert "<" not in deps


# ---------------------------------------------------------------- kernels: every branch, awkward shapes
S = jax.ShapeDtypeStruct
_I, _B, _F, _BF = jnp.int32, jnp.bool_, jnp.float32, jnp.bfloat16
# 13 rows, 3 clusters, 20 features / head dim 8 or 20, 5 query rows, 37 keys: no block size divides them
b, H, KV, T, L, R, K, D = 2, 4, 2, 5, 37, 13, 3, 20
AWKWARD = {
    "kl_drift_hd8": (functools.partial(KD.kl_drift, mode="token"),
                     (S((b, H, T, 8), _F), S((b, KV, L, 8), _F), S((b, L), _B), S((b, H, T, L), _F))),
    "kl_drift_hd20": (functools.partial(KD.kl_drift, mode="cluster"),
                      (S((b, H, K, 20), _BF), S((b, KV, L, 20), _BF), None, S((b, H, K, L), _F))),
    "gather_rows": (functools.partial(RF.gather_rows, dtype=_F),
                    (S((b, R, D), jnp.int8), S((b, 7), _I), S((b, 7), _B), S((b, R), _F))),
    "scatter_rows": (RF.scatter_rows, (S((b, L, D), _BF), S((b, 7, D), _BF), S((b, 7), _I), S((b, 7), _B))),
    "scatter_kv_rows": (RF.scatter_kv_rows,
                        (S((b, KV, L, 8), _F), S((b, KV, 7, 8), _F), S((b, 7), _I), S((b, 7), _B))),
    "centroid_shift": (RF.centroid_shift, (S((b, K, D), _F), S((b, R), _I), S((b, K), _F), S((b, R), _B),
                                           S((b, R, D), _F), S((b, R, D), _F))),
}


def _bind(f, args):
    """f with the ``None`` arguments bound (so only arrays are traced)."""
    idx = [i for i, a in enumerate(args) if a is not None]

    def g(*arrays):
        full = list(args)
        for i, a in zip(idx, arrays):
            full[i] = a
        return f(*full)

    return g, [args[i] for i in idx]


@pytest.mark.parametrize("backend", ["auto", "pallas", "interpret"])
@pytest.mark.parametrize("case", sorted(AWKWARD))
def test_kernels_trace_every_branch(case, backend):
    """Tracing (make_jaxpr) stages out every platform branch of the dispatch: the Triton and Mosaic
    kernels must be traceable on this CPU at shapes no block divides."""
    f, args = AWKWARD[case]
    g, arrays = _bind(functools.partial(f, backend=backend), args)
    with BK.staged():
        jaxpr = jax.make_jaxpr(g)(*arrays)
    if backend != "interpret":
        assert "pallas_call" in str(jaxpr)


@pytest.mark.parametrize("case", ["kl_drift_hd20", "scatter_rows"])
def test_kernels_outside_staged_trace_only_the_local_choice(case):
    """A plain trace picks the implementation of this process's backend then: on this CPU ``auto`` traces
    the reference alone (no Pallas kernel, no platform switch), ``pallas`` the interpreter's kernel."""
    if jax.default_backend() != "cpu":
        pytest.skip("the local choice checked here is the CPU's")
    f, args = AWKWARD[case]
    texts = {}
    for backend in ("auto", "pallas"):
        g, arrays = _bind(functools.partial(f, backend=backend), args)
        texts[backend] = str(jax.make_jaxpr(g)(*arrays))
    assert "pallas_call" not in texts["auto"] and "platform_index" not in texts["auto"]
    assert "pallas_call" in texts["pallas"] and "platform_index" not in texts["pallas"]


def test_export_after_a_plain_run_of_the_same_function_stages_the_kernels():
    """JAX caches traces by function and shapes: a function run here first (traced with the CPU's choice, the
    reference) and then exported for tpu must still get the Mosaic kernel (the staged trace is keyed apart),
    and a plain run after the export the reference again."""
    def f(q, k, p):
        return KD.kl_drift(q, k, None, p, mode="cluster")

    args = (jnp.ones((1, 4, 8, 16)), jnp.ones((1, 4, 32, 16)), jnp.full((1, 4, 8, 32), 1 / 32))
    jf = jax.jit(f)
    want = np.asarray(jf(*args)[0])
    text = compat.export(jf, platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in text
    assert "pallas_call" not in str(jax.make_jaxpr(f)(*args))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(*args)[0]), want)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("case", sorted(AWKWARD))
def test_kernels_export_awkward_shapes(case, platform):
    f, args = AWKWARD[case]
    g, arrays = _bind(f, args)
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = compat.export(jax.jit(g), platforms=[platform], disabled_checks=checks)(*arrays).mlir_module()
    if platform == "tpu" and case == "scatter_rows":  # bf16 rows: no Mosaic scatter (refresh.mosaic_rows_exclude)
        assert "tpu_custom_call" not in text and "scatter" in text
        return
    assert ("__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call") in text


def test_padded_triton_kernels_match_reference_in_interpreter():
    """The operands the Triton flavour pads (centroid shift: 13 rows / 3 clusters / 20 features; drift:
    head dim 8 and 20) give the reference's result, in one compile."""
    rng = np.random.default_rng(0)
    cent = rng.standard_normal((b, K, D)).astype(np.float32)
    labels = rng.integers(-1, K - 1, (b, R)).astype(np.int32)  # cluster K-1 empty
    counts = (labels[..., None] == np.arange(K)).sum(1).astype(np.float32)
    rows = rng.uniform(size=(b, R)) > 0.3
    h_old = rng.standard_normal((b, R, D)).astype(np.float32)
    h_new = (h_old + 0.3 * rng.standard_normal((b, R, D))).astype(np.float32)
    shift = tuple(jnp.asarray(a) for a in (cent, labels, counts, rows, h_old, h_new))

    def drift_args(hd, t):
        q = jnp.asarray(rng.standard_normal((b, H, t, hd)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((b, KV, L, hd)), jnp.float32)
        valid = jnp.asarray(rng.uniform(size=(b, L)) > 0.2)
        pp = rng.uniform(size=(b, H, t, L)).astype(np.float32)
        return q, k, valid, jnp.asarray(pp / pp.sum(-1, keepdims=True))

    drifts = [drift_args(8, T), drift_args(20, K)]

    @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
    def run(shift, drifts):
        out = [(RF.centroid_shift(*shift, interpret=True, flavor="triton"), RF.centroid_shift_reference(*shift))]
        for mode, d in zip(("token", "cluster"), drifts):
            out.append((KD.kl_drift(*d, mode=mode, interpret=True, flavor="triton"),
                        KD.kl_drift_reference(*d, mode=mode)))
        return out

    (got, want), *pairs = run(shift, drifts)
    assert got.shape == want.shape == (b, K, D)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[counts == 0], cent[counts == 0])
    for (dg, pg), (dw, pw) in pairs:
        assert dg.shape == dw.shape and pg.shape == pw.shape
        np.testing.assert_allclose(np.asarray(pg), np.asarray(pw), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(dg), np.asarray(dw), rtol=1e-4, atol=1e-6)
