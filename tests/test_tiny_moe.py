"""The bundled LLaDA-MoE test bed ``polestar_jax/assets/tiny_moe`` (issue #45): an HF folder of the family
``llada_moe`` under 4 MB, on which the checked dual cache and Polestar answer held-out copy and reverse
instances exactly, and whose router spreads the tokens over its experts in every layer."""
from __future__ import annotations

import os

import numpy as np
import pytest

from bench import tasks as T
from polestar_jax.config import DecodeConfig
from polestar_jax.io.tokenizer import asset_model_dir, load_tokenizer
from polestar_jax.models import llada_moe
from polestar_jax.models.family import FAMILIES

TINY_MOE = asset_model_dir("tiny_moe")
#: held-out instances per easy task (evaluation seeds, never trained on); one decode batch of 2 * N rows
N = 4


@pytest.fixture(scope="module")
def bed():
    from polestar_jax.io.checkpoint import generation_defaults, load_model

    cfg, params = load_model(TINY_MOE, dtype="float32")
    tok = load_tokenizer(TINY_MOE)
    items = [(task, p, a) for task in ("copy", "reverse") for p, a in T.eval_instances(task, N)]
    return cfg, params, tok, generation_defaults(TINY_MOE), items


def test_folder_is_a_small_llada_moe():
    import json

    with open(os.path.join(TINY_MOE, "config.json")) as f:
        hf = json.load(f)
    assert hf["architectures"] == ["LLaDAMoEModelLM"] and hf["num_experts_per_tok"] < hf["num_experts"]
    total = sum(os.path.getsize(os.path.join(TINY_MOE, n)) for n in os.listdir(TINY_MOE))
    assert total < 4 * 2**20, total
    readme = open(os.path.join(TINY_MOE, "README.md")).read()
    assert "python -m bench.train_tiny --preset tiny_moe" in readme and "## Expert use" in readme


@pytest.mark.parametrize("decoder", ["fastdllm-dual", "polestar"])
def test_cached_decoders_answer_copy_and_reverse(bed, decoder):
    """The checked dual cache (threshold 0.9) and Polestar (the family's defaults; one refresh width, a faster
    compile) at the trained lengths: every held-out copy / reverse instance exactly right."""
    from engines import generate  # tests/engines.py

    cfg, params, tok, gen, items = bed
    common = dict(gen_length=gen["gen_length"], block_length=gen["block_length"], threshold=0.9)
    dcfg = (DecodeConfig(decoder="fastdllm", cache="dual", step_after_full_pass=False, **common)
            if decoder == "fastdllm-dual" else
            DecodeConfig(decoder="polestar", polestar=FAMILIES["llada_moe"].polestar_config(refresh_buckets=1),
                         **common))
    res = generate(params, cfg, [tok.chat_prompt_ids(p) for _, p, _ in items], dcfg, early_exit=True)
    got = [T.decode_answer(tok, res.row(r).tokens) for r in range(len(items))]
    assert got == [a for _, _, a in items]
    assert sum(res.nfe) < len(items) * gen["gen_length"]  # and in fewer forwards than tokens


def test_router_uses_its_experts(bed):
    """In every layer the prompt and answer tokens of the easy instances go to most experts, none taking the
    lion's share (the load-balancing loss at work; a collapsed router would send all to k experts)."""
    cfg, params, tok, _, items = bed
    ids = tok.chat_prompt_ids(items[0][1]) + tok.encode(items[0][2])
    _, idx, weight = (np.asarray(a) for a in llada_moe.routing(params, np.asarray([ids], np.int32), cfg))
    e, k = cfg.moe.n_experts, cfg.moe.top_k
    for layer in range(cfg.n_layers):
        share = np.bincount(idx[layer].ravel(), minlength=e) / idx[layer].size
        assert (share > 0).sum() >= e // 2 and share.max() < 0.5, (layer, share)
    assert np.all(weight.sum(-1) < 1.0)  # raw top-k probabilities, not renormalised
