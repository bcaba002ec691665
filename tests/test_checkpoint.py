"""Checkpoint IO: the safetensors adapter, HF <-> params mapping, orbax conversion, export, the CLI."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from polestar_jax.io.checkpoint import (INDEX_FILE, export_hf, hf_shapes, hf_to_params, load_model, param_shapes,
                                        params_to_hf, read_hf_folder, save_converted)
from polestar_jax.config import ModelConfig
from polestar_jax.convert import convert_hf_to_orbax, convert_orbax_to_hf
from polestar_jax.convert.__main__ import main as convert_main
from polestar_jax.errors import CheckpointError, ConfigError, PolestarError
from polestar_jax.io.safetensors_io import read_safetensors, write_safetensors

TINY = Path(__file__).parent / "data" / "llada_tiny_a"
TINY_ST = TINY / "model.safetensors"


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_json(str(TINY))


@pytest.fixture(scope="module")
def hf_tensors() -> dict[str, np.ndarray]:
    return load_file(str(TINY_ST))


@pytest.fixture(scope="module")
def hf_model():
    """(cfg, params) loaded from the HF test folder."""
    return load_model(TINY)


def _assert_tree_equal(a, b, dtype=None) -> None:
    """Bit-exact equality of two params pytrees (same structure, shapes, dtypes, values)."""
    la, ta = jax.tree.flatten_with_path(a)
    lb, tb = jax.tree.flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype, path
        if dtype is not None:
            assert x.dtype == dtype, path
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=str(path))


def _hf_copy(dst: Path, tensors: dict[str, np.ndarray] | None = None, config: dict | None = None) -> Path:
    """An HF folder in ``dst``: the tiny config (or ``config``) and ``tensors`` (default: the tiny model)."""
    dst.mkdir(parents=True, exist_ok=True)
    if config is None:
        shutil.copyfile(TINY / "config.json", dst / "config.json")
    else:
        (dst / "config.json").write_text(json.dumps(config))
    if tensors is None:
        shutil.copyfile(TINY_ST, dst / "model.safetensors")
    else:
        write_safetensors(dst / "model.safetensors", tensors)
    return dst


# ------------------------------------------------------------------------------------------ safetensors IO

def test_lazy_reader_matches_eager_load(hf_tensors):
    ours = read_safetensors(TINY_ST)  # header checked now, each tensor read when looked up
    assert list(ours) == list(hf_tensors) and len(ours) == len(hf_tensors)
    for name, ref in hf_tensors.items():
        assert ours[name].dtype == ref.dtype and ours[name].shape == ref.shape, name
        np.testing.assert_array_equal(ours[name], ref, err_msg=name)


def test_writer_round_trip_all_dtypes(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((4,)).astype(np.float16),
        "bf16": rng.standard_normal((2, 3, 2)).astype(ml_dtypes.bfloat16),
        "f64": rng.standard_normal((2, 2)),
        "i32": rng.integers(-5, 5, (7,), dtype=np.int32),
        "i64": rng.integers(-5, 5, (1, 3), dtype=np.int64),
        "i8": rng.integers(-5, 5, (5,), dtype=np.int8),
        "u8": rng.integers(0, 255, (3,), dtype=np.uint8),
        "bool": np.array([True, False, True]),
        "scalar": np.float32(3.5),
        "empty": np.zeros((0, 4), np.float32),
        "jax": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3),
        "strided": np.arange(16, dtype=np.float32).reshape(4, 4)[:, ::2],  # written dense
    }
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt"})
    assert not (tmp_path / "t.safetensors.tmp").exists()
    for back in (read_safetensors(path), load_file(str(path))):
        assert set(back) == set(tensors)
        for name, ref in tensors.items():
            ref = np.asarray(ref)
            assert back[name].dtype == ref.dtype and back[name].shape == ref.shape, name
            np.testing.assert_array_equal(back[name], ref, err_msg=name)
    with pytest.raises(CheckpointError, match="cannot write") as e:
        write_safetensors(tmp_path / "c.safetensors", {"c": np.ones(2, np.complex128)})
    assert "\n" not in str(e.value) and not list(tmp_path.glob("c.safetensors*"))


def _cut(tmp_path: Path, n_bytes: int) -> Path:
    data = TINY_ST.read_bytes()
    p = tmp_path / "cut.safetensors"
    p.write_bytes(data[:n_bytes])
    return p


def _with_header(tmp_path: Path, header: bytes, data: bytes = b"") -> Path:
    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return p


@pytest.mark.parametrize("make, match", [
    (lambda d: d / "absent.safetensors", "not found"),
    (lambda d: _cut(d, 5), "at least 8"),
    (lambda d: _cut(d, 100), "header length"),
    (lambda d: _cut(d, -10), "truncated data"),
    (lambda d: _with_header(d, b"{not json!"), "invalid JSON"),
    (lambda d: _with_header(d, b"[1, 2]"), "JSON object"),
    (lambda d: _with_header(d, b'{"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4),
     "unknown dtype"),
    (lambda d: _with_header(d, b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', b"\0" * 8),
     "needs 8"),
    (lambda d: _with_header(d, b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}', b"\0" * 8),
     "invalid data_offsets"),
    (lambda d: _with_header(d, b'{"a": {"dtype": "F32", "shape": [1]}}'), "data_offsets"),
    (lambda d: _with_header(d, b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 8),
     "trailing bytes"),
])
def test_reader_errors(tmp_path, make, match):
    path = make(tmp_path)
    with pytest.raises(CheckpointError, match=match) as e:
        read_safetensors(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg


# -------------------------------------------------------------------------------------- HF <-> params

def test_hf_to_params_shapes_and_layout(cfg, hf_tensors):
    params = hf_to_params(hf_tensors, cfg)
    want = param_shapes(cfg)
    assert jax.tree.map(np.shape, params) == jax.tree.map(tuple, want, is_leaf=lambda x: isinstance(x, tuple))
    assert params["wte"].shape == (256, 64) and params["lm_head"].shape == (64, 256)
    assert params["blocks"]["wq"].shape == (2, 64, 64) and params["blocks"]["w_down"].shape == (2, 128, 64)
    pre = "model.transformer."
    np.testing.assert_array_equal(params["blocks"]["wq"][1], hf_tensors[pre + "blocks.1.q_proj.weight"].T)
    np.testing.assert_array_equal(params["blocks"]["w_gate"][0], hf_tensors[pre + "blocks.0.ff_proj.weight"].T)
    np.testing.assert_array_equal(params["blocks"]["w_down"][1], hf_tensors[pre + "blocks.1.ff_out.weight"].T)
    np.testing.assert_array_equal(params["blocks"]["attn_norm"][1], hf_tensors[pre + "blocks.1.attn_norm.weight"])
    np.testing.assert_array_equal(params["lm_head"], hf_tensors[pre + "ff_out.weight"].T)
    np.testing.assert_array_equal(params["wte"], hf_tensors[pre + "wte.weight"])
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))

    back = params_to_hf(params, cfg)
    assert set(back) == set(hf_tensors) == set(hf_shapes(cfg))
    for name, ref in hf_tensors.items():
        assert back[name].dtype == ref.dtype
        np.testing.assert_array_equal(back[name], ref, err_msg=name)


def test_hf_names_without_model_prefix(cfg, hf_tensors):
    short = {k.removeprefix("model."): v for k, v in hf_tensors.items()}
    _assert_tree_equal(hf_to_params(short, cfg), hf_to_params(hf_tensors, cfg))


def test_mapping_errors_name_the_tensor(cfg, hf_tensors):
    q = "model.transformer.blocks.1.q_proj.weight"
    missing = {k: v for k, v in hf_tensors.items() if k != q}
    with pytest.raises(CheckpointError, match=r"missing tensor model\.transformer\.blocks\.1\.q_proj\.weight"):
        hf_to_params(missing, cfg)
    extra = dict(hf_tensors, **{"model.transformer.blocks.2.q_proj.weight": hf_tensors[q]})
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.transformer\.blocks\.2\.q_proj"):
        hf_to_params(extra, cfg)
    bad = dict(hf_tensors, **{q: hf_tensors[q][:, :32]})
    with pytest.raises(CheckpointError,
                       match=r"blocks\.1\.q_proj\.weight has shape \(64, 32\), config expects \(64, 64\)"):
        hf_to_params(bad, cfg)
    ints = dict(hf_tensors, **{q: hf_tensors[q].astype(np.int32)})
    with pytest.raises(CheckpointError, match="non-floating"):
        hf_to_params(ints, cfg)
    with pytest.raises(ConfigError, match="dtype"):
        hf_to_params(hf_tensors, cfg, dtype="int8")


# --------------------------------------------------------------------------------- load / convert / export

def test_load_hf_folder_returns_jax_arrays(hf_model, cfg, hf_tensors):
    cfg2, params = hf_model
    assert cfg2 == cfg
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    _assert_tree_equal(params, hf_to_params(hf_tensors, cfg))


def test_orbax_round_trip_bit_exact(tmp_path, hf_model):
    out = tmp_path / "conv"
    summary = convert_hf_to_orbax(TINY, out)
    assert summary.n_tensors == 21 and summary.dtype == "float32"
    assert (out / "params").is_dir()
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["torch_dtype"] == "float32" and cfg_json["polestar_format"] == "orbax"
    cfg, params = load_model(out)
    assert cfg == hf_model[0]
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    _assert_tree_equal(params, hf_model[1], dtype=np.float32)

    # Overwriting an existing converted folder replaces its params.
    doubled = jax.tree.map(lambda x: x * 2, hf_model[1])
    save_converted(out, cfg, doubled)
    _assert_tree_equal(load_model(out)[1], doubled)

    # ... and back to HF: bit-exact to the original file.
    hf_out = tmp_path / "hf"
    convert_orbax_to_hf(TINY, hf_out)
    back = read_hf_folder(hf_out)
    ref = load_file(str(TINY_ST))
    assert set(back) == set(ref)
    for name in ref:
        np.testing.assert_array_equal(back[name], ref[name], err_msg=name)


def test_export_hf_round_trip(tmp_path, hf_model, hf_tensors):
    cfg, params = hf_model
    files = export_hf(tmp_path / "out", cfg, params)
    assert files == ["model.safetensors"] and not (tmp_path / "out" / INDEX_FILE).exists()
    back = load_file(str(tmp_path / "out" / "model.safetensors"))  # the reference reader agrees
    assert set(back) == set(hf_tensors)
    for name, ref in hf_tensors.items():
        assert back[name].dtype == ref.dtype
        np.testing.assert_array_equal(back[name], ref, err_msg=name)
    cfg2, params2 = load_model(tmp_path / "out")
    assert cfg2 == cfg
    _assert_tree_equal(params2, params)


def test_sharded_export_loads_through_index(tmp_path, hf_model):
    cfg, params = hf_model
    out = tmp_path / "sharded"
    (out).mkdir()
    (out / "model.safetensors").write_bytes(b"stale")  # a leftover from an earlier export is removed
    files = export_hf(out, cfg, params, max_shard_bytes=100_000)
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(params))
    assert all((out / f).stat().st_size <= 100_000 + 4096 for f in files)
    cfg2, params2 = load_model(out)
    _assert_tree_equal(params2, params)


def test_sharded_index_errors(tmp_path, hf_model):
    cfg, params = hf_model
    out = tmp_path / "sharded"
    files = export_hf(out, cfg, params, max_shard_bytes=100_000)
    index = json.loads((out / INDEX_FILE).read_text())

    moved = dict(index, weight_map=dict(index["weight_map"]))
    name = next(n for n, f in moved["weight_map"].items() if f == files[0])
    moved["weight_map"][name] = files[1]
    (out / INDEX_FILE).write_text(json.dumps(moved))
    with pytest.raises(CheckpointError, match=f"{name}.*missing from this shard"):
        read_hf_folder(out)

    (out / INDEX_FILE).write_text(json.dumps(index))
    os.remove(out / files[-1])
    with pytest.raises(CheckpointError, match=f"shard file {files[-1]}.*not found"):
        load_model(out)


def test_bfloat16_conversion(tmp_path, hf_model, hf_tensors):
    cfg, params32 = hf_model
    cast = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16), params32)
    _, direct = load_model(TINY, dtype="bfloat16")
    _assert_tree_equal(direct, cast, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(direct["wte"]), np.asarray(params32["wte"].astype(jnp.bfloat16)))

    out = tmp_path / "bf16"
    summary = convert_hf_to_orbax(TINY, out, dtype="bfloat16")
    assert summary.dtype == "bfloat16"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, restored = load_model(out)
    _assert_tree_equal(restored, cast, dtype=jnp.bfloat16)
    _, up = load_model(out, dtype=jnp.float32)  # cast on load
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(up))

    export_hf(tmp_path / "hf16", cfg, restored)
    back = read_safetensors(tmp_path / "hf16" / "model.safetensors")
    q = "model.transformer.blocks.0.q_proj.weight"
    assert back[q].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back[q], hf_tensors[q].astype(ml_dtypes.bfloat16))


# ------------------------------------------------------------------------------------------- load errors

def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="model folder not found"):
        load_model(tmp_path / "nope")


def test_load_truncated_and_garbage(tmp_path):
    d = _hf_copy(tmp_path / "trunc")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match="truncated data"):
        load_model(d)
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="header length"):
        load_model(d)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 16) + b"\x00garbage!garbage")
    with pytest.raises(CheckpointError, match="invalid JSON header"):
        load_model(d)
    os.remove(d / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(d)


def test_load_mismatched_tensors(tmp_path, hf_tensors):
    q = "model.transformer.blocks.0.k_proj.weight"
    d = _hf_copy(tmp_path / "missing", {k: v for k, v in hf_tensors.items() if k != q})
    with pytest.raises(CheckpointError, match=r"missing tensor model\.transformer\.blocks\.0\.k_proj\.weight"):
        load_model(d)
    d = _hf_copy(tmp_path / "extra", dict(hf_tensors, **{"model.transformer.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.transformer\.extra\.weight"):
        load_model(d)
    d = _hf_copy(tmp_path / "shape", dict(hf_tensors, **{q: np.zeros((64, 65), np.float32)}))
    with pytest.raises(CheckpointError, match=r"blocks\.0\.k_proj\.weight has shape \(64, 65\)"):
        load_model(d)
    # A config with fewer layers than the checkpoint: the extra layer's tensors are unexpected.
    config = json.loads((TINY / "config.json").read_text())
    d = _hf_copy(tmp_path / "layers", config=dict(config, n_layers=1))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.transformer\.blocks\.1\."):
        load_model(d)


@pytest.mark.parametrize("change, match", [
    ({"block_type": "sequential"}, "block_type"),
    ({"model_type": "llama"}, "model_type"),
    ({"weight_tying": True}, "weight_tying"),
])
def test_other_architecture(tmp_path, change, match):
    config = json.loads((TINY / "config.json").read_text())
    d = _hf_copy(tmp_path / "arch", config=dict(config, **change))
    with pytest.raises(ConfigError, match=match):
        load_model(d)


def test_converted_folder_config_mismatch(tmp_path, hf_model):
    cfg, params = hf_model
    out = tmp_path / "conv"
    save_converted(out, cfg, params)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, mlp_hidden_size=96)))
    with pytest.raises(CheckpointError, match=r"blocks/w_gate has shape \(2, 64, 128\), config expects \(2, 64, 96\)"):
        load_model(out)
    shutil.rmtree(out / "params")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="params"):
        load_model(out)


# -------------------------------------------------------------------------------------------------- CLI

def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    return subprocess.run([sys.executable, "-m", "polestar_jax.convert", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_cli_converts_and_exports(tmp_path, hf_model):
    out = tmp_path / "conv"
    r = _run_cli(str(TINY), str(out), "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) == 1
    assert "21 tensors" in r.stdout and "bfloat16" in r.stdout and str(out) in r.stdout
    _, params = load_model(out)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))

    # In-process back to HF, sharded (main() returns the exit status).
    assert convert_main(["--to-hf", str(out), str(tmp_path / "hf"), "--max-shard-mb", "0.05"]) == 0
    assert (tmp_path / "hf" / INDEX_FILE).is_file()
    _assert_tree_equal(load_model(tmp_path / "hf")[1], params)


def test_cli_errors_are_one_line(tmp_path, capsys):
    r = _run_cli(str(tmp_path / "nope"), str(tmp_path / "out"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: model folder not found: {tmp_path / 'nope'}"
    assert r.stdout == ""

    assert convert_main([str(TINY)]) == 2  # argparse errors too: main() returns the exit status
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1

    assert convert_main([str(TINY), str(tmp_path / "o"), "--dtype", "int4"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1

    d = _hf_copy(tmp_path / "bad", config={"model_type": "llama"})
    assert convert_main([str(d), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model_type" in err and len(err.strip().splitlines()) == 1
    assert issubclass(ConfigError, PolestarError)


@pytest.mark.parametrize("folder,drop,bad", [("llada_tiny_a", "d_model", ("activation_type", "gelu")),
                                             ("dream_tiny_a", "hidden_size", ("hidden_act", "gelu"))])
def test_config_dict_errors_name_the_field(folder, drop, bad):
    """Both families' config readers refuse a missing field and an unsupported value in one line."""
    import json

    from polestar_jax.config import ModelConfig
    from polestar_jax.errors import ConfigError

    d = json.loads((Path(__file__).parent / "data" / folder / "config.json").read_text())
    missing = {k: v for k, v in d.items() if k != drop}
    with pytest.raises(ConfigError, match=f"^x: missing field\\(s\\) {drop}$"):
        ModelConfig.from_dict(missing, "x")
    with pytest.raises(ConfigError, match=f"^x: unsupported {bad[0]}='{bad[1]}'"):
        ModelConfig.from_dict({**d, bad[0]: bad[1]}, "x")
