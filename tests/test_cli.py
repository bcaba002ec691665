"""The command lines: ``python -m polestar_jax.generate`` and ``python -m polestar_jax.crosscheck``.

Subprocesses pay the JAX import and their own compiles, so only a few run as subprocesses; the bad-input matrix
runs in-process through ``main()`` (the same code path after argument parsing) plus three subprocess spot checks.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polestar_jax import crosscheck
from polestar_jax import generate as gen_cli
from polestar_jax.io.tokenizer import bundled_model_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_A_DIR = Path(__file__).parent / "data" / "llada_tiny_a"
TIMEOUT = 120


def _run(env: dict, module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)


def _assert_one_error_line(code, out: str, err: str) -> None:
    assert code == 2, (code, out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:"), err
    assert "Traceback" not in err and "Traceback" not in out


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = gen_cli.main(argv)
    except SystemExit as e:  # argparse errors exit from inside main()
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------------------------- generate
def test_generate_json(subprocess_env):
    # --decoder fastdllm: the default decoder (polestar) compiles for ~20 s; its own tests cover it
    r = _run(subprocess_env, "polestar_jax.generate", "--prompt", "copy: ann,bob,cal", "--gen-length", "32",
             "--block-length", "8", "--json", "--decoder", "fastdllm")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stdout.splitlines()) == 1  # stdout is exactly one JSON document; the text went to stderr
    last = json.loads(r.stdout)
    assert {"text", "token_ids", "nfe", "tpf", "tps", "blocks", "finish_reason"} <= set(last)
    assert isinstance(last["text"], str) and last["text"] in r.stderr and "stats:" in r.stderr
    # early exit (the default): the decoded blocks only, up to the first block holding a stop token
    n = len(last["token_ids"])
    assert n == 8 * last["blocks"] and 8 <= n <= 32 and all(isinstance(t, int) for t in last["token_ids"])
    assert isinstance(last["nfe"], int) and last["blocks"] <= last["nfe"] <= 32 + 2 * 4
    assert last["tpf"] > 0 and last["tps"] >= 0
    if n < 32:
        assert last["finish_reason"] == "stop"
    # each program's first use; "from_store": loaded from the executable store (nothing traced)
    assert last["compiled"] and all(set(c) == {"what", "lower_seconds", "compile_seconds", "cache_hit", "from_store"}
                                    for c in last["compiled"])


def test_generate_loads_as_the_api_does(monkeypatch, capsys):
    """generate reads config.json once, loads through polestar_jax.api.Model, and its JSON rows are the API's
    rows (the same keys and values as ``load().generate`` on the same prompts)."""
    import dataclasses

    from polestar_jax import api
    from polestar_jax.config import ModelConfig

    reads, models = [], []
    real_read, real_init = ModelConfig.from_json.__func__, api.Model.__init__
    monkeypatch.setattr(ModelConfig, "from_json", classmethod(lambda cls, p: (reads.append(p), real_read(cls, p))[1]))
    monkeypatch.setattr(api.Model, "__init__", lambda self, *a, **k: (models.append(self), real_init(self, *a, **k))[1])
    prompts = ["copy: ann,bob,cal", "reverse: dan,eve"]
    code, out, err = _main([*sum((["--prompt", p] for p in prompts), []), "--decoder", "llada", "--json"], capsys)
    assert code == 0, err
    assert len(reads) == 1 and len(models) == 1
    rows = json.loads(out)["rows"]
    assert {f.name for f in dataclasses.fields(api.Generation)} == set(rows[0])
    want = models[0].generate(prompts, decoder="llada")
    for row, g in zip(rows, want):
        assert row == dict(g.to_dict(), tps=row["tps"])  # (tps: the job's own seconds)


def test_json_compile_records_say_from_store():
    from polestar_jax.engine.compile_cache import CompileRecord

    loaded = gen_cli.compile_record_json(CompileRecord("block", 0.0, 0.3, True, True))
    fresh = gen_cli.compile_record_json(CompileRecord("block", 1.2, 4.0, False))
    assert (loaded["from_store"], fresh["from_store"]) == (True, False) and "stored" not in loaded


@pytest.fixture(scope="module")
def bad_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_models")
    out = {}
    d = root / "corrupt"  # a truncated model.safetensors
    d.mkdir()
    shutil.copy(TINY_A_DIR / "config.json", d / "config.json")
    data = (TINY_A_DIR / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    out["corrupt"] = d
    d = root / "arch"  # another architecture
    d.mkdir()
    config = json.loads((TINY_A_DIR / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, model_type="llama", block_type="sequential")))
    shutil.copy(TINY_A_DIR / "model.safetensors", d / "model.safetensors")
    out["arch"] = d
    d = root / "tiny_a_tok"  # tiny_a (max_sequence_length 512) with the bundled byte-level tokenizer
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(TINY_A_DIR / name, d / name)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(bundled_model_dir()) / name, d / name)
    out["tiny_a_tok"] = d
    out["missing"] = root / "does_not_exist"
    d = root / "bad_genconfig"  # the bundled model with a broken generation_config.json
    shutil.copytree(bundled_model_dir(), d)
    (d / "generation_config.json").write_text(json.dumps({"gen_length": "long", "block_length": 8}))
    out["bad_genconfig"] = d
    d = root / "bad_shapes"  # a config.json whose shapes disagree (64 model dims over 3 heads)
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(config, d_model=64, n_heads=3, n_kv_heads=3)))
    shutil.copy(TINY_A_DIR / "model.safetensors", d / "model.safetensors")
    out["bad_shapes"] = d
    return out


BAD_INPUTS = {  # name -> (argv builder, expected message part)
    "missing_model": (lambda f: ["--model", str(f["missing"]), "--prompt", "Hi"], "not found"),
    "corrupt_safetensors": (lambda f: ["--model", str(f["corrupt"]), "--prompt", "Hi"], "safetensors"),
    "other_architecture": (lambda f: ["--model", str(f["arch"]), "--prompt", "Hi"], "llama"),
    "gen_not_multiple_of_block": (lambda f: ["--prompt", "Hi", "--gen-length", "30", "--block-length", "8"],
                                  "multiple"),
    "steps_not_divisible": (lambda f: ["--prompt", "Hi", "--gen-length", "32", "--block-length", "8",
                                       "--steps", "30"], "steps"),
    "prompt_too_long": (lambda f: ["--model", str(f["tiny_a_tok"]), "--no-chat", "--prompt", "x" * 600,
                                   "--gen-length", "32", "--block-length", "8"], "max_sequence_length"),
    "bad_generation_config": (lambda f: ["--model", str(f["bad_genconfig"]), "--prompt", "Hi"], "gen_length"),
    # the message names the file, not the class that checked it
    "inconsistent_config": (lambda f: ["--model", str(f["bad_shapes"]), "--prompt", "Hi"],
                            "bad_shapes/config.json: d_model 64 is not divisible by n_heads 3"),
    "inconsistent_config_dry_run": (lambda f: ["--model", str(f["bad_shapes"]), "--dry-run"],
                                    "bad_shapes/config.json: d_model 64 is not divisible by n_heads 3"),
    "empty_prompt": (lambda f: ["--prompt", ""], "empty"),
    "blank_prompt": (lambda f: ["--prompt", "   "], "empty"),
    "no_prompt": (lambda f: [], "prompt"),
    "unknown_decoder": (lambda f: ["--prompt", "Hi", "--decoder", "bogus"], "--decoder"),
    "bad_threshold": (lambda f: ["--prompt", "Hi", "--threshold", "high"], "threshold"),
    "threshold_out_of_range": (lambda f: ["--prompt", "Hi", "--threshold", "1.5"], "threshold"),
    "bad_refresh_buckets": (lambda f: ["--prompt", "Hi", "--refresh-buckets", "0"], "refresh_buckets"),
}


def test_generate_lengths_default_to_the_model_folder(tmp_path, capsys):
    """Without --gen-length/--block-length the model folder's generation_config.json decides; flags win."""
    d = tmp_path / "m"
    shutil.copytree(bundled_model_dir(), d)
    cfg = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps(dict(cfg, gen_length=16, block_length=8, steps=16)))
    for extra, n in (([], 16), (["--gen-length", "24"], 24)):
        code, out, err = _main(["--model", str(d), "--prompt", "copy: ann,bob", "--decoder", "llada", "--json",
                                "--no-early-exit", *extra], capsys)
        assert code == 0, err
        assert len(json.loads(out.strip().splitlines()[-1])["token_ids"]) == n


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_generate_bad_input_in_process(name, bad_folders, capsys):
    argv, part = BAD_INPUTS[name]
    code, out, err = _main(argv(bad_folders), capsys)
    _assert_one_error_line(code, out, err)
    assert part in err, err


@pytest.mark.parametrize("name", ["missing_model", "corrupt_safetensors", "unknown_decoder"])
def test_generate_bad_input_subprocess(name, bad_folders, subprocess_env):
    argv, part = BAD_INPUTS[name]
    r = _run(subprocess_env, "polestar_jax.generate", *argv(bad_folders))
    _assert_one_error_line(r.returncode, r.stdout, r.stderr)
    assert part in r.stderr


# -------------------------------------------------------------------------------------------- crosscheck
def _golden_copy(folder: Path, tiny_a_cases: dict, names: list[str], logits: int = 0) -> dict:
    """A golden folder in ``folder`` holding the model, the first ``logits`` logits cases and the generate
    cases named ``names`` (in that order); returns the cases.json content (the caller writes it)."""
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(TINY_A_DIR / name, folder / name)
    for case in tiny_a_cases["logits_cases"][:logits]:
        for key in ("file", "hidden_states_file"):
            if case.get(key):
                shutil.copy(TINY_A_DIR / case[key], folder / case[key])
    by_name = {c["name"]: c for c in tiny_a_cases["generate_cases"]}
    return dict(tiny_a_cases, logits_cases=tiny_a_cases["logits_cases"][:logits],
                generate_cases=[json.loads(json.dumps(by_name[n])) for n in names])


def test_crosscheck_golden_folder(subprocess_env, tiny_a_cases, tmp_path):
    """``python -m polestar_jax.crosscheck FOLDER`` on a copy with two logits cases and one generate case of
    each reference function (the 41-token prompt): exit 0 and the summary line. (The whole folder, 123 cases,
    is replayed in-process by tests/test_engine.py and through this command by .ci/run.)"""
    assert len(tiny_a_cases["logits_cases"]) + len(tiny_a_cases["generate_cases"]) == 123
    names = [f"{fn}/p2/g32_b8_s32/thr_{thr}" for fn, thr in (
        ("llada.generate", "none"), ("fastdllm.generate", "0.9"), ("fastdllm.generate_with_prefix_cache", "0.9"),
        ("fastdllm.generate_with_dual_cache", "0.9"))]
    folder = tmp_path / "subset"
    data = _golden_copy(folder, tiny_a_cases, names, logits=2)
    (folder / "cases.json").write_text(json.dumps(data))
    r = _run(subprocess_env, "polestar_jax.crosscheck", str(folder))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "6 passed, 0 failed"


def test_crosscheck_reports_an_altered_token(subprocess_env, tiny_a_cases, tmp_path):
    """A copy with one generated token changed (in ``generated_ids``, ``output_ids`` and the trajectory) fails
    exactly that case and names the forward that committed it."""
    folder = tmp_path / "altered"
    keep = ["fastdllm.generate/p2/g32_b8_s32/thr_0.9", "fastdllm.generate/p2/g32_b8_s32/thr_0.5"]
    data = _golden_copy(folder, tiny_a_cases, keep)
    cases = data["generate_cases"]
    assert [c["name"] for c in cases] == keep
    victim = cases[1]
    plen = len(victim["prompt_ids"])
    forward = 3
    pos, tok = victim["trajectory"][forward][0]  # the first token committed by forward 3
    new = (tok + 1) % 254
    victim["trajectory"][forward][0] = [pos, new]
    victim["generated_ids"][pos - plen] = new
    victim["output_ids"][pos] = new
    (folder / "cases.json").write_text(json.dumps(data))

    r = _run(subprocess_env, "polestar_jax.crosscheck", str(folder))
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    fail = [line for line in lines if victim["name"] in line]
    assert len(fail) == 1 and "first diverging forward" in fail[0], r.stdout
    assert f"first diverging forward {forward}:" in fail[0], fail[0]
    assert keep[0] not in r.stdout
    assert lines[-1] == "1 passed, 1 failed"


def test_crosscheck_missing_folder(tmp_path, capsys):
    code = crosscheck.main([str(tmp_path / "nope")])
    out, err = capsys.readouterr()
    _assert_one_error_line(code, out, err)
    assert "not found" in err


def test_polestar_flags_reach_the_config():
    args = gen_cli.build_parser().parse_args(["--prompt", "Hi", "--refresh-buckets", "2", "--offload-hidden", "int8",
                                              "--kernels", "reference"])
    pc = gen_cli.decode_config_from_args(args).polestar
    assert (pc.refresh_buckets, pc.offload_hidden, pc.kernels) == (2, "int8", "reference")
    auto = gen_cli.decode_config_from_args(gen_cli.build_parser().parse_args(["--prompt", "Hi"])).polestar
    # none: made concrete for the program's platform (a GPU's refresh step reads every weight anyway)
    assert auto.refresh_buckets is None and auto.for_platform("cpu").refresh_buckets == 4
    assert auto.for_platform("cuda").refresh_buckets == auto.for_platform("gpu").refresh_buckets == 1
    assert pc.for_platform("gpu") is pc  # a number given is kept
