"""The block program's shared parts: declared state axes, row selection, the commit writer, the policy
registry and the one state builder (issue #14)."""
from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax.axes import axes as axes_decl
from polestar_jax.decode import block
from polestar_jax.config import DecodeConfig, ModelConfig
from polestar_jax.errors import ConfigError
from polestar_jax.models.family import FAMILIES, family_of
from polestar_jax.decode.layout import init_decode_state
from polestar_jax.decode.state import axes_of, row_key_data, select_rows

CFG = ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=48, vocab_size=64,
                  embedding_size=64, mask_token_id=63, eos_token_id=62, pad_token_id=62, max_sequence_length=128)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


def _state(decoder="polestar", **kw):
    dc = DecodeConfig(decoder=decoder, cache="none" if decoder == "llada" else "dual", gen_length=16,
                      block_length=8, threshold=None if decoder == "llada" else 0.9, **kw)
    return init_decode_state(CFG, dc, PROMPTS, 8, seed=3)


def test_every_field_declares_its_batch_axis():
    """Each array leaf of the whole decode state has the batch (b = 3) at its declared axis, and a
    ``model`` axis only on head dimensions; the abstract build has the same structure and shapes."""
    state = _state()
    b = len(PROMPTS)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    axes = jax.tree.leaves(axes_of(state), is_leaf=lambda a: hasattr(a, "spec"))
    assert len(leaves) == len(axes) > 20
    for (path, leaf), ax in zip(leaves, axes):
        assert leaf.shape[ax.batch] == b, (jax.tree_util.keystr(path), leaf.shape, ax)
        if "model" in ax.spec:
            assert leaf.shape[ax.spec.index("model")] in (CFG.n_heads, CFG.n_kv_heads), jax.tree_util.keystr(path)
    abstract = init_decode_state(CFG, DecodeConfig(decoder="polestar", gen_length=16, block_length=8),
                                 PROMPTS, 8, seed=3, abstract=True)
    chex.assert_trees_all_equal_shapes_and_dtypes(abstract, state)


@pytest.mark.parametrize("in_step", [False, True])
def test_select_rows_keeps_inactive_rows_and_leaves_the_store(in_step):
    """Row selection per field: the store (``select=False``) taken as is; the proxy attention
    (``select="start"``) selected after a block start, taken as is after a step; every other field row by row."""
    old = _state()
    new = jax.tree.map(lambda a: a + jnp.ones((), a.dtype) if a.dtype != bool else ~a, old)
    active = jnp.asarray([True, False, True])
    got = select_rows(active, new, old, in_step=in_step)
    as_is = {"store": 0, "start": 0}
    for (path, g), n, o, ax in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(new),
                                  jax.tree.leaves(old),
                                  jax.tree.leaves(axes_of(old), is_leaf=lambda a: hasattr(a, "spec"))):
        g, n, o = map(np.asarray, (g, n, o))
        take = lambda a, r: np.take(a, r, axis=ax.batch)
        if ax.select is False or (in_step and ax.select == "start"):  # taken as is
            as_is["store" if ax.select is False else "start"] += 1
            np.testing.assert_array_equal(g, n)
            continue
        for r, act in enumerate(np.asarray(active)):
            np.testing.assert_array_equal(take(g, r), take(n if act else o, r), err_msg=jax.tree_util.keystr(path))
    assert as_is["store"] > 0 and as_is["start"] == (1 if in_step else 0), as_is


def test_a_field_selects_in_one_of_three_ways():
    for bad in ("step", 1, None):
        with pytest.raises(ValueError, match="select must be True, False or 'start'"):
            axes_decl(select=bad)
    assert axes_decl(select="".join(["st", "art"])).metadata["select"] == "start"  # (equal, not the same object)


def test_commit_writer_block_and_positions_agree():
    s = _state("fastdllm")
    cs = 8
    transfer = jnp.asarray(np.random.default_rng(0).random((3, 8)) < 0.5)
    x0 = jnp.arange(24, dtype=jnp.int32).reshape(3, 8)
    a = block.write_commits(s, transfer, x0, start=cs, count=jnp.asarray([True, False, True]))
    b = block.write_commits(s, transfer, x0, positions=cs + jnp.arange(8)[None])
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.commit_step, b.commit_step)
    np.testing.assert_array_equal(a.nfe, [1, 0, 1])
    np.testing.assert_array_equal(b.nfe, s.nfe)
    want = np.where(np.asarray(transfer), np.asarray(x0), np.asarray(s.x)[:, cs:cs + 8])
    np.testing.assert_array_equal(np.asarray(a.x)[:, cs:cs + 8], want)
    np.testing.assert_array_equal(np.asarray(a.commit_step)[:, cs:cs + 8], np.where(np.asarray(transfer), 0, -1))


def test_every_decoder_is_a_policy_of_the_one_block_program():
    for decoder in ("llada", "fastdllm", "polestar"):
        p = block.policy_for(decoder)
        assert isinstance(p, block.Policy)
        assert all(callable(f) for f in p[:5])
        # a policy's own part of the state comes through its hooks (only Polestar keeps one)
        assert (p.own is not None) == (decoder == "polestar")
        assert p.own is None or all(callable(f) for f in p.own)


def test_policies_and_families_join_through_registries():
    from polestar_jax.decode.policy import POLICIES, register_policy
    from polestar_jax.errors import ConfigError
    from polestar_jax.models.family import FAMILIES, LLADA, register_family

    with pytest.raises(ValueError, match="decoder 'llada' is already registered"):
        register_policy("llada", block.policy_for("fastdllm"))
    with pytest.raises(ValueError, match="model family 'dream' is already registered"):
        register_family(dataclasses.replace(LLADA, name="dream"))
    with pytest.raises(ConfigError, match=r"unknown decoder 'nope' \(registered: .*fastdllm"):
        block.policy_for("nope")
    with pytest.raises(ConfigError, match=r"unknown model family 'nope' \(registered: llada, dream"):
        family_of(dataclasses.replace(CFG, family="nope"))
    mine = register_family(dataclasses.replace(LLADA, name="mine"))
    try:
        assert FAMILIES["mine"] is mine and "mine" in FAMILIES and {"llada", "fastdllm", "polestar"} <= set(POLICIES)
    finally:
        FAMILIES.unregister("mine")
    assert "mine" not in FAMILIES
    spec = block.EngineSpec.from_config(CFG, DecodeConfig(decoder="polestar", gen_length=16, block_length=8))
    assert spec.unroll == 1 and block.EngineSpec.from_config(
        CFG, DecodeConfig(decoder="polestar", gen_length=16, block_length=8), unroll=True).unroll is True


def test_row_keys_and_families():
    np.testing.assert_array_equal(row_key_data(5, 7), [5, 7])
    np.testing.assert_array_equal(row_key_data(0, 3), np.asarray(jax.random.key_data(jax.random.PRNGKey(3))))
    keys = {tuple(row_key_data(s, r)) for s in range(4) for r in range(4)}
    assert len(keys) == 16  # (seed, row) pairs never share a key (seed + row did)
    with pytest.raises(Exception, match="seed must be in"):
        row_key_data(-1, 0)
    assert family_of(CFG) is FAMILIES["llada"]
    with pytest.raises(ConfigError, match="unknown model family"):
        family_of(dataclasses.replace(CFG, family="gpt"))
    fam = FAMILIES["llada"]
    assert fam.cache_shape(CFG, 3, 24) == (2, 3, 2, 24, 8)  # KV heads, not expanded heads
    # logit alignment: a shifted family predicts position p from row p-1 (the span's first row twice)
    h = jnp.asarray(np.random.default_rng(1).normal(size=(1, 6, CFG.d_model)), jnp.float32)
    params = {"ln_f": jnp.ones((CFG.d_model,)), "lm_head": jnp.eye(CFG.d_model, CFG.embedding_size)}
    shifted = dataclasses.replace(fam, logit_shift=1)
    same = np.asarray(fam.head_at(params, h, CFG, 2, 3))
    np.testing.assert_allclose(same, np.asarray(fam.lm_head(params, h[:, 2:5], CFG)))
    np.testing.assert_allclose(np.asarray(shifted.head_at(params, h, CFG, 2, 3)), np.asarray(fam.lm_head(params, h[:, 1:4], CFG)))
    first = np.asarray(shifted.head_at(params, h, CFG, 0, 2))
    np.testing.assert_allclose(first[:, 0], first[:, 1])
