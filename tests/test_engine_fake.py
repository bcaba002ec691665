"""The block program driven by the fake model family (``tests/fake_family.py``: one-hot logits that spell a
fixed script, so every forward's commits are known in advance): the tests pin the loop bounds and NFE
accounting of each sampler, per-row blocks, insertion into a running batch and early exit, in about a second.
"""
from __future__ import annotations

import numpy as np
import pytest

from polestar_jax.config import DecodeConfig
from polestar_jax.decode.block import compact_width
from polestar_jax.engine.engine import Engine, RunningBatch
from bench.fake_family import B, CFG, EOS_AT, MASK, PARAMS, expected, registered


@pytest.fixture(scope="module")
def engine():
    with registered():
        yield Engine(PARAMS, CFG)


PROMPTS = [[3, 4, 5], [3] * 11]  # EOS at generation index 11 (block 2) and 3 (block 0)
FIRST_EOS_BLOCK = [2, 0]


@pytest.mark.parametrize("sampler, per_block", [
    (dict(decoder="llada", cache="none", threshold=None), 4),        # steps_per_block forwards, exactly
    (dict(decoder="fastdllm", cache="none"), 1),                      # one forward fills the block
    (dict(decoder="fastdllm", cache="dual"), 2),                      # full start + the forced step
    (dict(decoder="fastdllm", cache="dual", step_after_full_pass=False), 1),
    (dict(decoder="fastdllm", cache="prefix"), 2),
])
def test_loop_bounds_nfe_and_early_exit(engine, sampler, per_block):
    for early in (False, True):
        dc = DecodeConfig(gen_length=16, block_length=B, steps=16, early_exit=early, **sampler)
        res = engine.run(PROMPTS, dc, prompt_slot=12)
        for r, (p, first) in enumerate(zip(PROMPTS, FIRST_EOS_BLOCK)):
            blocks = first + 1 if early else 4
            row = res.row(r)
            assert len(row.block_nfe) == blocks and int(res.blocks[r]) == blocks
            np.testing.assert_array_equal(row.tokens, expected(len(p))[: blocks * B])
            assert row.nfe == per_block * blocks and list(row.block_nfe) == [per_block] * blocks
            assert (res.tokens[r, blocks * B:] == MASK).all()  # blocks never decoded stay masked
            c = engine.completion(row)
            assert c.finish_reason == "stop" and c.response_ids == list(expected(len(p))[: EOS_AT - len(p)])


def test_per_row_blocks_insertion_and_leaving(engine):
    """Rows of one running batch sit at different blocks; a row inserted mid-stream gets what it gets alone;
    a done row leaves and its slot is reused, without a new compile."""
    dc = DecodeConfig(decoder="fastdllm", cache="dual", gen_length=16, block_length=B)
    batch = engine.batch(dc, 2, 12)
    n_programs = engine.executable_count
    a = batch.insert([3, 4, 5], tag="a")                # EOS in block 2
    batch.step()
    b = batch.insert([3] * 11, tag="b", gen_length=8)   # joins at a's block 1; EOS in its block 0
    assert (a, b) == (0, 1) and batch.progress()[0].tolist() == [1, 0]
    batch.step()
    blk, done = batch.progress()
    assert blk.tolist() == [2, 1] and done.tolist() == [False, True]  # b stopped early
    out = batch.finished()
    assert [r.index for r in out] == ["b"] and batch.free_slots == [1]
    np.testing.assert_array_equal(out[0].tokens, expected(11)[:B])
    c = batch.insert([3, 4, 5, 6, 7, 8, 9], tag="c", gen_length=16)  # takes b's slot at a's block 2
    assert c == 1
    for _ in range(4):
        batch.step()
    rows = {r.index: r for r in batch.finished()}
    assert set(rows) == {"a", "c"} and batch.occupied == 0
    np.testing.assert_array_equal(rows["a"].tokens, expected(3)[:12])
    np.testing.assert_array_equal(rows["c"].tokens, expected(7)[:8])  # EOS at generation index 7: block 1
    assert rows["a"].nfe == 2 * 3 and rows["c"].nfe == 2 * 2
    assert engine.executable_count == n_programs  # nothing recompiled


def test_a_cancelled_row_is_not_decoded_again(engine):
    """A slot freed between calls (a client that left) costs no further block: its row's block counter and
    forwards stay where they were, while the other row goes on (the frees reach the device with the next
    call, all at once)."""
    dc = DecodeConfig(decoder="fastdllm", cache="dual", gen_length=16, block_length=B)
    batch = engine.batch(dc, 2, 12)
    batch.insert([3, 4, 5], tag="a")
    batch.insert([3, 4], tag="b")
    batch.step()
    batch.cancel(1)
    nfe = int(batch.state.nfe[1])
    batch.step()
    blk, _ = batch.progress()
    assert blk.tolist() == [2, 1] and int(batch.state.nfe[1]) == nfe and batch.free_slots == [1]
    c = batch.insert([3, 4, 5, 6], tag="c")  # the slot is reused: the new row starts at its block 0
    batch.step()
    assert c == 1 and batch.progress()[0].tolist() == [3, 1]


def test_continuous_job_keeps_the_batch_full(engine):
    dc = DecodeConfig(decoder="fastdllm", cache="none", gen_length=16, block_length=B)
    prompts = [[3] * n for n in (3, 11, 5, 9, 2, 12, 4)]
    job = engine.generate(prompts, dc, batch_size=3, prompt_slot=12)
    for p, r in zip(prompts, job.rows):
        blocks = (EOS_AT - len(p)) // B + 1
        np.testing.assert_array_equal(r.tokens, expected(len(p))[: blocks * B])
    # 7 rows on 3 slots: fewer block calls than 7 rows decoded one batch of 3 after another to the end
    assert job.block_calls < 3 * 4


@pytest.mark.parametrize("sampler, per_block", [
    (dict(decoder="llada", cache="none", threshold=None), 4),
    (dict(decoder="fastdllm", cache="dual"), 2),
])
def test_compacted_steps_count_every_row_once(engine, sampler, per_block):
    """Block starts and steps in chunks of 2 of a 5-row running batch (the last chunk padded with a row that
    takes part as inactive): every row at its own block gets its tokens and exactly its forwards (a start run
    twice on a row would count a forward more), as in a full-width call."""
    dc = DecodeConfig(gen_length=16, block_length=B, steps=16, **sampler)
    prompts = [[3] * n for n in (3, 11, 5, 9, 2, 12, 4)]
    batch = RunningBatch(engine, dc, 5, 12, compact_rows=2)
    assert batch.spec.compact_rows == 2
    queue, out = list(range(len(prompts))), {}
    while queue or batch.occupied:
        while queue and batch.free_slots:
            i = queue.pop(0)
            batch.insert(prompts[i], tag=i)
        batch.step()
        out.update({r.index: r for r in batch.finished()})
    for i, p in enumerate(prompts):
        blocks = (EOS_AT - len(p)) // B + 1
        np.testing.assert_array_equal(out[i].tokens, expected(len(p))[: blocks * B])
        assert out[i].nfe == per_block * blocks and list(out[i].block_nfe) == [per_block] * blocks
    spec = engine.spec(dc)  # automatic: an eighth of the batch, at least 8 rows, from 16 rows up
    assert [compact_width(n, spec) for n in (4, 15, 16, 72, 128)] == [0, 0, 8, 9, 16]
    assert compact_width(72, spec, sharded=True) == 0
    # on a GPU a step is bound by its weight reads: every chunk would read all the weights again
    assert compact_width(72, spec, platform="gpu") == compact_width(72, spec, platform="cuda") == 0
    assert compact_width(72, spec, platform="tpu") == 9
