"""The server's scheduler (continuous batching at block granularity) without HTTP: exact under load for every
decoder, streaming by block, stop strings, cancellation, a full queue, a failing step, draining.

Each decoder's scheduler decodes 16 jobs of mixed lengths and seeds on 4 rows (jobs join as rows finish;
each step runs on the rows still active, in chunks of 2); every job's tokens must equal the prompt decoded alone (batch 1, its own prompt slot, a generation region of
its own length). The bundled ``tiny_tasks`` model (gen 32, block 8).
"""
from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from polestar_jax.api import load
from polestar_jax.serving.scheduler import Job, NotAccepting, QueueFull, Scheduler, cut_at_stop

TEXTS = ["reverse: jan,kat,leo,pat", "copy: rex,val,jan", "sort: pat,jan,kat", "remove 2: jan,kat,leo,pat,rex",
         "insert val at 1: jan,kat,leo", "copy: kat,leo,pat,rex,val", "reverse: val,rex", "replace 2 with jan: kat,leo,pat"]
GENS = [32, 8, 24, 16]
DECODERS = {"llada": dict(decoder="llada"), "fastdllm-none": dict(decoder="fastdllm", cache="none"),
            "fastdllm-prefix": dict(decoder="fastdllm", cache="prefix"),
            "fastdllm-dual": dict(decoder="fastdllm", cache="dual"), "polestar": dict(decoder="polestar")}


@pytest.fixture(scope="module")
def model():
    return load(compile_cache=False)  # (the suite runs without a persistent cache: conftest.py)


def _jobs(model, n=16, temperature=None):
    """n jobs: prompts, lengths and seeds mixed; results land in the returned dict (job index -> events)."""
    events: dict[int, list] = {i: [] for i in range(n)}
    done = threading.Event()
    left = [n]
    lock = threading.Lock()

    def sink(i):
        def on_event(ev):
            events[i].append(ev)
            if ev.kind in ("done", "error"):
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
        return on_event

    jobs = [Job(prompt=model.prompt_ids(TEXTS[i % len(TEXTS)]), gen_length=GENS[i % len(GENS)], on_event=sink(i),
                seed=i % 5, stream=i % 3 == 0, temperature=temperature(i) if temperature else None)
            for i in range(n)]
    return jobs, events, done


def _alone(model, job, dcfg):
    """The job's prompt decoded alone: batch 1, its generation length (in a region of the decoder's length
    whose tail is hidden from attention: that this equals a region of its own length, and that the prompt
    slot does not matter, is :func:`test_own_length_region_and_slot_do_not_matter`)."""
    dc = dataclasses.replace(dcfg, temperature=job.temperature or 0.0)
    return model.engine.run([job.prompt], dc, seed=job.seed, rows=[0], prompt_slot=64,
                            gen_lengths=[job.gen_length]).row(0)


def test_own_length_region_and_slot_do_not_matter(model):
    """A prompt alone with gen length 16 in its own slot (48) = the same row with gen length 16 in a region
    of 32 (the tail hidden) and a slot of 64, for Polestar (whose windows reach past the block)."""
    dcfg = model.decode_config(gen_length=32)
    for text in TEXTS[:2]:
        ids = model.prompt_ids(text)
        own = model.engine.run([ids], dataclasses.replace(dcfg, gen_length=16), seed=3).row(0)
        hidden = model.engine.run([ids], dcfg, seed=3, prompt_slot=64, gen_lengths=[16]).row(0)
        np.testing.assert_array_equal(own.tokens, hidden.tokens)
        assert own.nfe == hidden.nfe and own.polestar["early"] == hidden.polestar["early"]


@pytest.mark.parametrize("name", list(DECODERS))
def test_exact_under_load(model, name):
    """16 concurrent jobs of mixed lengths on 4 rows: each gets the tokens it gets alone; streamed blocks add up
    to the response; every job's row left early or at its last block."""
    dcfg = model.decode_config(gen_length=32, **DECODERS[name])
    # (Polestar: half the jobs sample; the server's sampling program with temperature 0 gives greedy tokens)
    temperature = (lambda i: 0.0 if i % 2 else 0.8) if name == "polestar" else None
    # (steps in chunks of 2 rows: the rows still active gathered, as a large batch runs by default)
    sched = Scheduler(model.engine, dcfg, max_batch=4, prompt_slot=64, max_queue=16, compact_rows=2).start()
    try:
        jobs, events, done = _jobs(model, temperature=temperature)
        for j in jobs:
            sched.submit(j)
        assert done.wait(300), "jobs did not finish"
    finally:
        sched.stop()
    assert sched.blocks_run < sum(j.gen_length for j in jobs) // 8  # rows shared the batch's blocks
    for i, job in enumerate(jobs):
        evs = events[i]
        assert evs[-1].kind == "done", evs[-1].message
        got = evs[-1].row
        want = _alone(model, job, dcfg)
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=f"{name} job {i}")
        assert got.nfe == want.nfe
        c = model.engine.completion(want)
        assert evs[-1].text == model.tokenizer.decode(c.response_ids)
        if job.stream:
            assert "".join(e.text for e in evs if e.kind == "block") == evs[-1].text


def test_windowed_and_full_block_starts_in_one_call(model):
    """Polestar in a running batch: rows whose block starts differ in kind share one block call (row 0 at its
    block 3, a windowed start; rows 1-2 at block 0, full starts; row 3 free), and each gets its tokens
    alone. (The batch is the scheduler's sampling program of test_exact_under_load: no new compile.)"""
    from polestar_jax.engine.engine import RunningBatch

    dcfg = model.decode_config(gen_length=32, decoder="polestar")
    assert dcfg.polestar.windowed_period == 4 and dcfg.num_blocks == 4
    batch = RunningBatch(model.engine, dcfg, 4, 64, sampling=True)
    # (row 0's answer reaches its last block: no early exit before block 3)
    ids = [model.prompt_ids(t) for t in ("copy: kat,leo,pat,rex,val,jan,ivy,gus,hal", TEXTS[0], TEXTS[5])]
    batch.insert(ids[0], seed=2, row=0, tag=0)
    for _ in range(3):
        batch.step()
    assert batch.progress()[0][0] == 3 and not batch.progress()[1][0], "row 0 must still be decoding"
    batch.insert(ids[1], seed=1, row=0, tag=1)
    batch.insert(ids[2], seed=4, row=0, tag=2, temperature=0.7)
    rows = {}
    while batch.occupied:
        batch.step()
        rows.update({r.index: r for r in batch.finished()})
    full = {int(v) for v in rows[1].polestar["full_pass"]} | {int(v) for v in rows[2].polestar["full_pass"]}
    assert int(rows[0].polestar["windowed"][3]) == 1 and 1 in full
    for tag, seed, temp in ((0, 2, 0.0), (1, 1, 0.0), (2, 4, 0.7)):
        want = model.engine.run([ids[tag]], dataclasses.replace(dcfg, temperature=temp), seed=seed, rows=[0],
                                prompt_slot=64).row(0)
        np.testing.assert_array_equal(rows[tag].tokens, want.tokens[: len(rows[tag].tokens)], err_msg=f"row {tag}")
        assert rows[tag].nfe == want.nfe


def test_stop_strings_cancel_and_queue(model):
    dcfg = model.decode_config(gen_length=32, decoder="fastdllm")
    sched = Scheduler(model.engine, dcfg, max_batch=2, prompt_slot=64, max_queue=2)
    got = []
    mk = lambda text, **kw: Job(prompt=model.prompt_ids(text), gen_length=32, on_event=got.append, **kw)
    # not started: the queue fills, then refuses
    sched.submit(mk("copy: jan,kat,leo,pat,rex"))
    sched.submit(mk("copy: jan,kat,leo,pat,rex", stop=(",leo",)))
    with pytest.raises(QueueFull):
        sched.submit(mk("copy: jan"))
    with pytest.raises(Exception, match="prompt has"):
        sched.submit(Job(prompt=[1] * 65, gen_length=32, on_event=got.append))
    with pytest.raises(Exception, match="multiple of the block length"):
        sched.submit(Job(prompt=[1, 2], gen_length=12, on_event=got.append))
    sched.start()
    t0 = time.time()
    while len([e for e in got if e.kind == "done"]) < 2 and time.time() - t0 < 120:
        time.sleep(0.05)
    done = [e for e in got if e.kind == "done"]
    texts = sorted(e.text for e in done)
    assert texts == ["jan,kat", "jan,kat,leo,pat,rex"]
    stopped = next(e for e in done if e.text == "jan,kat")
    assert stopped.completion.finish_reason == "stop"
    # a cancelled job's row leaves at the next block boundary; the scheduler holds nothing afterwards
    job = mk("reverse: jan,kat,leo,pat,rex")
    sched.submit(job)
    job.cancel()
    t0 = time.time()
    while (sched.active_rows or sched.queue_length) and time.time() - t0 < 60:
        time.sleep(0.05)
    assert sched.active_rows == 0 and sched.queue_length == 0 and sched.batch.occupied == 0
    # a step that fails fails its batch's jobs (an error event) and the scheduler goes on serving
    real_step, calls = sched.batch.step, []

    def broken():
        calls.append(1)
        raise RuntimeError("boom")

    sched.batch.step = broken
    errs = []
    sched.submit(Job(prompt=model.prompt_ids("copy: jan,kat"), gen_length=16, on_event=errs.append))
    t0 = time.time()
    while not errs and time.time() - t0 < 60:
        time.sleep(0.05)
    assert errs and errs[-1].kind == "error" and "boom" in errs[-1].message and calls
    ok = []
    sched.submit(Job(prompt=model.prompt_ids("copy: jan,kat,leo"), gen_length=16, on_event=ok.append))
    t0 = time.time()
    while not ok and time.time() - t0 < 60:
        time.sleep(0.05)
    assert ok[-1].kind == "done" and ok[-1].text == "jan,kat,leo"
    assert sched.batch.step is not broken and real_step is not None  # a fresh batch replaced the broken one
    # draining: no new jobs, the running ones finish
    assert sched.drain(30)
    with pytest.raises(NotAccepting):
        sched.submit(mk("copy: jan"))
    sched.stop()
    assert not sched.running


def test_cut_at_stop():
    assert cut_at_stop("abc,def", [",d", "x"]) == ("abc", True)
    assert cut_at_stop("abc", ["x"]) == ("abc", False)
    assert cut_at_stop("abcabc", ["c", "b"]) == ("a", True)


@pytest.mark.parametrize("name", ["fastdllm-dual", "polestar"])
def test_dream_family_exact_under_load(name):
    """The Dream family (the bundled random tiny_dream: Qwen2 layout, logit shift, its own Polestar
    parameters): 8 jobs of mixed lengths on 3 rows, each = the prompt alone."""
    from polestar_jax.io.tokenizer import asset_model_dir

    dream = load(asset_model_dir("tiny_dream"))
    dcfg = dream.decode_config(gen_length=32, block_length=8, **DECODERS[name])
    # (steps in chunks of 2 of the 3 rows: the last chunk padded with a row that takes part as inactive)
    sched = Scheduler(dream.engine, dcfg, max_batch=3, prompt_slot=64, max_queue=8, compact_rows=2).start()
    try:
        jobs, events, done = _jobs(dream, n=8)
        for j in jobs:
            sched.submit(j)
        assert done.wait(300), "jobs did not finish"
    finally:
        sched.stop()
    for i, job in enumerate(jobs):
        got = events[i][-1].row
        dc = dataclasses.replace(dcfg, temperature=0.0)
        want = dream.engine.run([job.prompt], dc, seed=job.seed, rows=[0], prompt_slot=64,
                                gen_lengths=[job.gen_length]).row(0)
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=f"dream {name} job {i}")
        assert got.nfe == want.nfe


def test_batch_wait_holds_the_next_block_for_returning_clients(model):
    """After rows finish, the loop waits (at most ``batch_wait`` x the last block call) for new jobs to fill
    the freed slots: it returns as soon as they arrive, at the deadline if none do, and at once when the
    queue already fills them or the scheduler drains."""
    dcfg = model.decode_config(gen_length=32, decoder="fastdllm")  # (test_stop_strings_cancel_and_queue's program)
    with pytest.raises(Exception, match="batch_wait"):
        Scheduler(model.engine, dcfg, max_batch=2, prompt_slot=64, batch_wait=1.5)
    sched = Scheduler(model.engine, dcfg, max_batch=2, prompt_slot=64, batch_wait=0.5)  # (not started)
    job = lambda: Job(prompt=model.prompt_ids("copy: jan"), gen_length=8, on_event=lambda ev: None)
    t0 = time.perf_counter()
    sched._await_arrivals(finished=1, block_seconds=0.6)  # nobody comes: the whole window (0.3 s)
    assert 0.28 <= time.perf_counter() - t0 < 2.0
    later = threading.Timer(0.05, lambda: sched.submit(job()))
    t0 = time.perf_counter()
    later.start()
    sched._await_arrivals(finished=1, block_seconds=20.0)  # a 10 s window, ended by the arrival
    assert sched.queue_length == 1 and time.perf_counter() - t0 < 5.0
    t0 = time.perf_counter()
    sched._await_arrivals(finished=1, block_seconds=20.0)  # the queue already fills the freed slot
    assert time.perf_counter() - t0 < 0.5
    threading.Timer(0.05, lambda: sched.drain(0)).start()
    t0 = time.perf_counter()
    sched._await_arrivals(finished=2, block_seconds=20.0)  # draining: nobody new will come
    assert time.perf_counter() - t0 < 5.0
    sched.stop()
