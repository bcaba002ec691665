"""Batches, sharding over a simulated 8-device mesh (in a subprocess), and memory planning."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from polestar_jax.config import DecodeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")


_MESH_SCRIPT = r"""
import json, sys
import jax
import numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
assert len(jax.devices()) == 8, jax.devices()
from polestar_jax import crosscheck, sharding
from polestar_jax.io.checkpoint import load_model
from polestar_jax.config import DecodeConfig
import os as _os, sys as _sys  # tests/engines.py: the folder above the data folder argv[1]
_p = _os.path.abspath(_sys.argv[1])
while not _os.path.exists(_os.path.join(_p, "engines.py")):
    _p = _os.path.dirname(_p)
_sys.path.insert(0, _p)
from engines import generate  # noqa: E402
data = sys.argv[1]
mesh = sharding.make_mesh("data=2,model=4")
cfg, params = load_model(data + "/polestar_tiny_p", dtype="float32")
a, b = [5, 17, 33, 2, 99, 140, 7, 61, 8, 200, 13, 4], [9, 8, 7, 6, 5]

def same(x, r, y, s):  # row r of result x == row s of result y: tokens, forwards and (Polestar) statistics
    ok = x.tokens[r].tolist() == y.tokens[s].tolist() and int(x.nfe[r]) == int(y.nfe[s])
    ok = ok and x.commit_step[r].tolist() == y.commit_step[s].tolist() and x.block_stats(r) == y.block_stats(s)
    return bool(ok and (x.polestar is None or all(x.polestar[k][r].tolist() == y.polestar[k][s].tolist()
                                                    for k in x.polestar)))

out = {}
# Polestar, 4 blocks (block 3 starts with the windowed pass), default refresh widths
dc = DecodeConfig(decoder="polestar", cache="dual", gen_length=32, block_length=8, threshold=0.9)
both = generate(params, cfg, [a, b], dc, seed=7, rows=[11, 22], prompt_slot=16)
for row, (p, r) in enumerate(((a, 11), (b, 22))):  # rows of different lengths together = alone
    alone = generate(params, cfg, [p], dc, seed=7, rows=[r], prompt_slot=16)
    out[f"polestar batch row {row} = alone"] = same(both, row, alone, 0)
sh = generate(params, cfg, [a, b], dc, seed=7, rows=[11, 22], prompt_slot=16, mesh=mesh)
out["polestar/dual mesh = one device"] = all(same(both, r, sh, r) for r in (0, 1))
# the initial state is built on its shards (K/V cache over data x model), equal to the one-device state
from polestar_jax.decode.layout import init_decode_state
st = init_decode_state(cfg, dc, [a, b], 16, seed=7, rows=[11, 22], mesh=mesh)
ref = init_decode_state(cfg, dc, [a, b], 16, seed=7, rows=[11, 22])
leaves, want = jax.tree.leaves(st), jax.tree.leaves(sharding.state_shardings(ref, mesh))
out["state built sharded"] = bool(
    all(x.sharding == w for x, w in zip(leaves, want)) and tuple(st.k_cache.sharding.spec)[1:3] == ("data", "model")
    and all((np.asarray(x) == np.asarray(y)).all() for x, y in zip(leaves, jax.tree.leaves(ref))))
for dec, cache, thr in (("llada", "none", None), ("fastdllm", "prefix", 0.9)):
    dc = DecodeConfig(decoder=dec, cache=cache, gen_length=16, block_length=8, threshold=thr)
    one = generate(params, cfg, [a, b], dc, seed=7, rows=[1, 2], prompt_slot=16)
    sh = generate(params, cfg, [a, b], dc, seed=7, rows=[1, 2], prompt_slot=16, mesh=mesh)
    out[f"{dec}/{cache} mesh = one device"] = all(same(one, r, sh, r) for r in (0, 1))
# (one refresh width: the sharded compiles of every width branch would dominate this test; the Polestar
# decode above runs the default widths on the mesh, and tokens do not depend on them: tests/test_refresh.py)
# kernels.backend._per_shard: under the mesh a kernel call runs per device on its rows, split over `data`
# where it divides the batch, replicated where not: a row-dependent "kernel" shows which rows each call saw,
# and the Mosaic-layout drift kernel (interpreted) split over the rows equals its reference
import jax.numpy as jnp
from polestar_jax.kernels import backend as kb, kl_drift as kd
minus_first = kb._per_shard(lambda x: [x - x[:1]])
x4 = jnp.arange(12, dtype=jnp.float32).reshape(4, 3)
with jax.set_mesh(mesh):
    y4, = jax.jit(minus_first)(x4)
    y3, = jax.jit(minus_first)(x4[:3])
split = np.concatenate([np.asarray(x4[:2] - x4[0]), np.asarray(x4[2:] - x4[2])])
out["kernel call split over data"] = bool(np.array_equal(np.asarray(y4), split)
                                          and np.array_equal(np.asarray(y3), np.asarray(x4[:3] - x4[0])))
kq = jax.random.split(jax.random.key(3), 4)
q, k = jax.random.normal(kq[0], (4, 4, 8, 16)), jax.random.normal(kq[1], (4, 2, 24, 16))
valid = jax.random.uniform(kq[2], (4, 24)) > 0.2
pp = jax.nn.softmax(jax.random.normal(kq[3], (4, 4, 8, 24)), axis=-1)
drift_split = kb._per_shard(lambda *a: list(kd.kl_drift(*a, mode="token", interpret=True, flavor="mosaic")))
with jax.set_mesh(mesh):
    got = jax.jit(drift_split)(q, k, valid, pp)
want = kd.kl_drift_reference(q, k, valid, pp, mode="token")
out["kernel split = reference"] = all(np.allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
                                      for g, w in zip(got, want))
res = crosscheck.replay_polestar_folder(data + "/polestar_tiny_p", params, cfg, batch=2, mesh=mesh,
                                        refresh_buckets=1)
out["crosscheck_polestar"] = [r.name for r in res if r.status != "pass"]
out["n_cases"] = len(res)
print("RESULT " + json.dumps(out))
"""


def test_mesh_and_batch_rows_match_single_device_and_replay_golden():
    """One subprocess with 8 simulated CPU devices (mesh data=2 x model=4), several checks: Polestar rows of
    different lengths decoded together get exactly what they get alone (tokens, forwards, commit steps,
    block and Polestar statistics); the initial state is built on its shards; every decoder on the mesh
    gives what one device gives; the Polestar golden folder replays exactly on the mesh (batched 2 at a
    time); a kernel call under the mesh runs per device on its rows (``kernels.backend._per_shard``)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, DATA], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    assert out.pop("crosscheck_polestar") == []
    assert out.pop("n_cases") == 16
    assert len(out) == 8 and all(out.values()), out


def test_crosscheck_batched_llada_format(tiny_a):
    """The LLaDA/Fast-dLLM golden cases replayed 4 at a time (mixed prompt lengths, rows finishing blocks at
    different steps) match exactly, as `crosscheck --batch 4` does."""
    from polestar_jax import crosscheck

    cfg, params = tiny_a
    res = crosscheck.replay_llada_folder(os.path.join(DATA, "llada_tiny_a"), params, cfg, batch=4)
    with open(os.path.join(DATA, "llada_tiny_a", "cases.json")) as f:
        cases = json.load(f)
    assert len(res) == len(cases["logits_cases"]) + len(cases["generate_cases"])
    assert [f"{r.name}: {r.detail}" for r in res if r.status != "pass"] == []


def test_dry_run_plans_8b_from_config_only(capsys):
    """--dry-run sizes the 8B model from its config.json alone (abstract arrays, no weights)."""
    from polestar_jax.generate import main
    from polestar_jax.engine.plan import plan
    from polestar_jax.config import ModelConfig

    cfg = ModelConfig.from_json(os.path.join(DATA, "llada8b_config.json"))
    dc = DecodeConfig(decoder="polestar", gen_length=256, block_length=32)
    mp = plan(cfg, dc, batch=2, prompt_len=128, dtype="bfloat16", compile_step=False)
    n_params = (2 * cfg.embedding_size * cfg.d_model + cfg.d_model
                + cfg.n_layers * (4 * cfg.d_model ** 2 + 3 * cfg.d_model * cfg.mlp_hidden_size + 2 * cfg.d_model))
    assert mp.param_bytes == 2 * n_params
    length = 128 + 256
    assert mp.kv_bytes_per_seq == 2 * cfg.n_layers * cfg.d_model * length * 2
    assert mp.hs_bytes_per_seq == cfg.n_layers * 3 * 32 * (cfg.d_model * 2 + 4)  # bf16 rows + f32 scales
    rc = main(["--dry-run", "--model-config", os.path.join(DATA, "llada8b_config.json"), "--gen-length", "64",
               "--block-length", "32", "--decoder", "fastdllm", "--dtype", "float32"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "parameters: 29.86" in out and "compiled block step" in out


def test_bad_mesh_is_a_one_line_error(capsys):
    from polestar_jax.generate import main

    assert main(["--prompt", "x", "--mesh", "data=two"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


def test_generate_cli_several_prompts(tmp_path, capsys, monkeypatch):
    """Several prompts (repeated --prompt and --prompts-file) decode as one batch; each response is printed
    with its own stats, and the JSON line carries one entry per row."""
    from polestar_jax.generate import main

    monkeypatch.setenv("POLESTAR_JAX_CACHE", "off")
    pf = tmp_path / "prompts.txt"
    pf.write_text("third prompt\n\nfourth\n")
    rc = main(["--prompt", "Hello", "--prompt", "A longer second prompt", "--prompts-file", str(pf),
               "--decoder", "fastdllm", "--gen-length", "16", "--block-length", "8", "--json"])
    assert rc == 0
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()  # with --json the responses and stats go to stderr
    assert sum(line.startswith("--- [") for line in err) == 4
    assert sum(line.startswith("[fastdllm/dual] nfe=") for line in err) == 4
    assert len(cap.out.splitlines()) == 1
    last = json.loads(cap.out)
    assert len(last["text"]) == len(last["nfe"]) == len(last["token_ids"]) == 4
    # early exit: each row's decoded blocks (8 or 16 ids)
    assert all(len(t) in (8, 16) for t in last["token_ids"])
