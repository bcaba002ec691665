"""Options that mean what they say: config validation, flags and help generated from the configs, bad bytes,
and Polestar honouring the temperature (issue #11, sections 2-3)."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from polestar_jax import cli
from polestar_jax import generate as gen_cli
from polestar_jax.config import DecodeConfig, PolestarConfig
from polestar_jax.errors import ConfigError, PolestarError


def _main(argv, capsys):
    code = gen_cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(code, out, err, part):
    assert code == 2, (code, out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err + out
    assert part in lines[0], lines[0]


# ------------------------------------------------------------------------------------------ config level
@pytest.mark.parametrize("kwargs, part", [
    ({"top_k": 0}, "top_k must be >= 1"),
    ({"top_k": 9}, "top_k 9 is larger than the number of clusters 8"),
    ({"top_k_last": 9}, "top_k_last 9 is larger"),
    ({"refresh": False}, "suffix_precommit"),  # suffix pre-commit needs refreshed rows
    ({"suffix_blocks": 0}, "suffix window"),
    ({"top_k_last": 0}, "top_k_last >= 1"),
    ({"gate_max_delta": 0.0}, "gate_max_delta"),
    ({"early_threshold": 1.0}, "early_threshold"),
])
def test_polestar_config_rejects_no_op_settings(kwargs, part):
    with pytest.raises(ConfigError, match=part):
        PolestarConfig(**kwargs)


@pytest.mark.parametrize("kwargs, part", [
    ({"polestar": PolestarConfig(n_clusters=30)}, "larger than the window rows 24"),
    ({"polestar": PolestarConfig(refresh_buckets=25)}, "refresh_buckets 25 is larger than the window rows 24"),
    ({"polestar": PolestarConfig(early_threshold=0.9)}, "early commit could never fire"),
    ({"threshold": 0.6}, "early commit could never fire"),
    ({"remasking": "random"}, "low_confidence only"),
])
def test_polestar_decode_config_rejects_no_op_settings(kwargs, part):
    with pytest.raises(ConfigError, match=part):
        DecodeConfig(**{"decoder": "polestar", "gen_length": 32, "block_length": 8, **kwargs})


def test_polestar_settings_need_the_polestar_decoder():
    with pytest.raises(ConfigError, match="apply to decoder 'polestar' only"):
        DecodeConfig(decoder="fastdllm", polestar=PolestarConfig(top_k=2))
    DecodeConfig(decoder="fastdllm")  # the defaults are fine
    # the commit-only ablation is a valid configuration
    DecodeConfig(decoder="polestar", gen_length=32, block_length=8,
                 polestar=PolestarConfig(refresh=False, suffix_precommit=False))


# --------------------------------------------------------------------------------------------- CLI level
BAD = {
    "top_k_zero": (["--top-k", "0"], "--no-refresh"),
    "top_k_above_clusters": (["--top-k", "9"], "larger than the number of clusters"),
    "clusters_above_window": (["--clusters", "30"], "window rows"),
    "polestar_knob_other_decoder": (["--decoder", "fastdllm", "--top-k", "3"],
                                    "--top-k applies to decoder polestar only"),
    "two_knobs_llada": (["--decoder", "llada", "--kernels", "reference", "--no-suffix-commit"],
                        "--no-suffix-commit, --kernels apply to decoder polestar only"),
    "steps_with_threshold": (["--decoder", "fastdllm", "--steps", "16"], "--steps applies to the fixed schedule"),
    "threshold_with_llada": (["--decoder", "llada", "--threshold", "0.5"], "threshold"),
    "threshold_and_factor": (["--decoder", "fastdllm", "--threshold", "0.5", "--factor", "1"], "either"),
    "plan_flag_without_dry_run": (["--batch", "2"], "--batch applies to --dry-run only"),
    "prompt_length_without_dry_run": (["--prompt-length", "64"], "--prompt-length applies to --dry-run only"),
    "early_not_below_threshold": (["--early-threshold", "0.95"], "never fire"),
    "random_remasking_polestar": (["--remasking", "random"], "low_confidence only"),
    "no_refresh_with_suffix_commit": (["--no-refresh"], "--no-suffix-commit"),
    "model_is_a_file": (["--model", "README.md"], "is a file, not a folder"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_generate_rejects_what_would_be_ignored(name, capsys):
    argv, part = BAD[name]
    code, out, err = _main(["--prompt", "copy: ann", *argv], capsys)
    _one_error_line(code, out, err, part)


def test_dry_run_model_that_is_a_file(capsys):
    code, out, err = _main(["--dry-run", "--model", "README.md"], capsys)
    _one_error_line(code, out, err, "README.md is a file, not a folder")
    code, out, err = _main(["--dry-run", "--prompt", "hi"], capsys)
    _one_error_line(code, out, err, "--prompt is not used by --dry-run")


def test_dry_run_plans_the_stored_dtype(capsys):
    """Without --dtype, --dry-run plans for the weights as a load without --dtype keeps them (the bundled
    model: float32, its config.json's torch_dtype), as --help says; --dtype casts."""
    import json

    from polestar_jax.io.tokenizer import bundled_model_dir

    folder = bundled_model_dir()
    assert json.load(open(f"{folder}/config.json"))["torch_dtype"] == "float32"
    n = 871_552  # tiny_tasks's parameters (its README)
    base = ["--dry-run", "--decoder", "llada", "--json"]
    for argv, dtype, width in (([], "float32 (config.json torch_dtype)", 4), (["--dtype", "bfloat16"],
                                                                             "bfloat16 (--dtype)", 2)):
        code, out, err = _main(base + argv, capsys)
        assert code == 0, err
        assert f"dtype={dtype}" in out.splitlines()[0]
        assert json.loads(out.strip().splitlines()[-1])["param_bytes"] == width * n
    assert "--dry-run plans for the torch_dtype config.json declares" in " ".join(
        gen_cli.build_parser().format_help().split())
    data = os.path.join(os.path.dirname(__file__), "data")
    assert gen_cli.stored_dtype(os.path.join(data, "llada8b_config.json")) == (
        "bfloat16", "assumed: config.json declares no torch_dtype")
    assert gen_cli.stored_dtype(os.path.join(data, "dream7b_config.json"))[0] == "bfloat16"


def test_crosscheck_file_instead_of_folder(capsys):
    from polestar_jax import crosscheck

    code = crosscheck.main(["README.md"])
    out, err = capsys.readouterr()
    _one_error_line(code, out, err, "README.md is a file, not a folder")


def test_help_is_generated_from_the_configs(capsys):
    code, out, _ = _main(["--help"], capsys)
    assert code == 0
    text = " ".join(out.split())
    assert "tiny random" not in text and "tiny_tasks" in text
    for cls in (PolestarConfig, DecodeConfig):
        for f in dataclasses.fields(cls):
            if "help" not in f.metadata:
                continue
            flag = f.metadata.get("negate") if f.default is True and f.metadata.get("negate") else \
                cli.flag_of(cls, f.name)
            assert flag in text, flag
            default = f.metadata.get("cli_default", f.default)
            if default is not None and not isinstance(default, bool):
                # the default printed right after the field's help text
                assert f"{' '.join(f.metadata['help'].split())} (default: {default})" in text, f.name
    assert "--threshold THRESHOLD confidence threshold (fastdllm and polestar)" in text


def test_every_flag_reaches_its_field():
    """Each generated flag sets its own field (and only it); documented aliases work too."""
    parser = gen_cli.build_parser()
    values = {"n_clusters": "6", "prefix_blocks": "3", "suffix_blocks": "2", "kmeans_iters": "3", "top_k": "2",
              "top_k_last": "2", "windowed_period": "3", "trigger_commits": "2", "trigger_accum": "3",
              "history": "4", "early_threshold": "0.6", "gate_center": "0.8", "gate_scale": "5",
              "gate_max_delta": "1.5", "kernels": "reference", "offload_hidden": "bf16", "refresh_buckets": "2"}
    argv = ["--prompt", "x"]
    for name, v in values.items():
        argv += [cli.flag_of(PolestarConfig, name), v]
    pc = gen_cli.decode_config_from_args(parser.parse_args(argv)).polestar
    for name, v in values.items():
        kind = int if name == "refresh_buckets" else type(getattr(PolestarConfig(), name))  # (its default: none)
        assert str(getattr(pc, name)) == str(kind(v)), name
    assert gen_cli.decode_config_from_args(parser.parse_args(["--n-clusters", "5"])).polestar.n_clusters == 5
    pc = gen_cli.decode_config_from_args(parser.parse_args(["--no-refresh", "--no-suffix-commit"])).polestar
    assert (pc.refresh, pc.suffix_precommit) == (False, False)
    pc = gen_cli.decode_config_from_args(parser.parse_args(["--early-threshold", "none"])).polestar
    assert pc.early_threshold is None
    dc = gen_cli.decode_config_from_args(parser.parse_args(["--threshold", "0.8"]))
    assert dc.threshold == 0.8 and dc.decoder == "polestar"
    dc = gen_cli.decode_config_from_args(parser.parse_args(["--decoder", "fastdllm", "--threshold", "none",
                                                            "--steps", "16", "--gen-length", "32"]))
    assert (dc.rule, dc.steps) == ("fixed", 16)


# --------------------------------------------------------------------------------------------- bad bytes
def test_prompt_argument_that_is_not_utf8(capsys):
    bad = b"rev\xff\xfe".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    code, out, err = _main(["--prompt", "ok", "--prompt", bad], capsys)
    _one_error_line(code, out, err, "--prompt 1 is not valid UTF-8 (byte offset 3)")


def test_prompts_file_that_is_not_utf8(tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    good = "copy: ann\nrevé".encode()
    f.write_bytes(good + b"\xff\n")
    code, out, err = _main(["--prompts-file", str(f)], capsys)
    _one_error_line(code, out, err, f"prompts file {f} is not valid UTF-8 (byte offset {len(good)})")
    code, out, err = _main(["--prompts-file", str(tmp_path)], capsys)
    _one_error_line(code, out, err, "is a folder, not a file")


def test_check_utf8_counts_bytes_not_characters():
    with pytest.raises(PolestarError, match=r"byte offset 4\)"):
        cli.check_utf8("é" * 2 + b"\xff".decode("utf-8", "surrogateescape"), "x")
    assert cli.check_utf8("ok é", "x") == "ok é"


# ----------------------------------------------------------------------------- Polestar honours temperature
def test_polestar_samples_with_temperature():
    """T > 0 under Polestar: outputs depend on T and on the seed, and a fixed (T, seed) reproduces."""
    from bench import tasks as T
    from polestar_jax.io.checkpoint import load_model
    from engines import generate  # tests/engines.py
    from polestar_jax.io.tokenizer import bundled_model_dir, load_tokenizer

    cfg, params = load_model(bundled_model_dir())
    tok = load_tokenizer(bundled_model_dir())
    prompts = [tok.chat_prompt_ids(p) for p, _ in T.eval_instances("shuffle", 4)]
    base = DecodeConfig(decoder="polestar", gen_length=32, block_length=8)

    def run(t, seed=0):
        return generate(params, cfg, prompts, dataclasses.replace(base, temperature=t), seed=seed,
                        prompt_slot=64).tokens

    greedy, warm, hot = run(0.0), run(0.7), run(10.0)
    assert not np.array_equal(warm, hot) and not np.array_equal(greedy, hot)
    np.testing.assert_array_equal(run(10.0), hot)  # reproducible
    assert not np.array_equal(run(10.0, seed=1), hot)  # the seed keys the noise
    np.testing.assert_array_equal(run(0.0), greedy)
