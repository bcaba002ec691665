"""The server's scheduler driven by the fake model family (``tests/fake_family.py``): every job's tokens,
response text, finish reason, forwards and streamed blocks are known by hand, and a run takes milliseconds
of compute, so the scheduler's own logic (admission into free slots, streaming by block, stop strings,
``max_tokens``, cancellation, a full queue, stopping) is pinned apart from any trained model (the tests of
``test_scheduler.py`` check the same loop on the bundled model, against each decoder decoding alone)."""
from __future__ import annotations

import threading

import pytest

from bench.fake_family import B, CFG, EOS, EOS_AT, PARAMS, LetterTokenizer, expected, registered
from polestar_jax.config import DecodeConfig
from polestar_jax.engine.engine import Engine
from polestar_jax.errors import PolestarError
from polestar_jax.serving.scheduler import Job, NotAccepting, QueueFull, Scheduler

GEN, SLOT = 16, 12
DCFG = DecodeConfig(decoder="fastdllm", cache="none", gen_length=GEN, block_length=B)  # one forward a block


@pytest.fixture(scope="module")
def engine():
    with registered():
        yield Engine(PARAMS, CFG, tokenizer=LetterTokenizer())


def want(plen: int, gen: int = GEN, max_tokens=None, stop: str = ""):
    """(text, finish reason, forwards) of a job, by hand: the script's tokens up to the first EOS (a block
    a forward), cut at ``max_tokens`` or before a stop string."""
    tokens = [int(t) for t in expected(plen, gen)]
    n = tokens.index(EOS) if EOS in tokens else gen
    blocks = min(gen // B, n // B + 1)  # early exit after the block that holds the EOS
    text, reason = LetterTokenizer().decode(tokens[:n]), "stop" if n < gen else "length"
    if max_tokens is not None and len(text) > max_tokens:
        text, reason = text[:max_tokens], "length"
    if stop and stop in text:
        cut = text.index(stop)
        text, reason, blocks = text[:cut], "stop", cut // B + 1  # the row leaves after the block that shows it
    return text, reason, blocks


def run(sched: Scheduler, jobs: list[Job], timeout: float = 60.0) -> dict[int, list]:
    """Submits ``jobs`` and waits for each to end; returns job index -> its events."""
    events = {i: [] for i in range(len(jobs))}
    left, done = [len(jobs)], threading.Event()
    lock = threading.Lock()
    for i, job in enumerate(jobs):
        def on_event(ev, i=i):
            events[i].append(ev)
            if ev.kind in ("done", "error"):
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
        job.on_event = on_event
        sched.submit(job)
    assert done.wait(timeout), "jobs did not finish"
    return events


@pytest.fixture(scope="module")
def sched(engine):
    s = Scheduler(engine, DCFG, max_batch=2, prompt_slot=SLOT, max_queue=16, sampling=False, batch_wait=0.0).start()
    yield s
    s.stop()
    assert not s.running


def test_every_job_gets_its_script(sched):
    """More jobs than slots, of different prompt and generation lengths: each gets exactly its tokens, with
    the finish reason and forwards counted by hand (one forward a block, early exit after the EOS block)."""
    lens = [3, 11, 5, 9, 2, 12, 6]
    gens = [16, 8, 16, 4, 16, 8, 12]
    events = run(sched, [Job(prompt=[3] * n, gen_length=g, on_event=None) for n, g in zip(lens, gens)])
    for i, (n, g) in enumerate(zip(lens, gens)):
        (done,) = [e for e in events[i] if e.kind == "done"]
        text, reason, blocks = want(n, g)
        assert (done.text, done.completion.finish_reason, done.completion.nfe) == (text, reason, blocks), i
        assert done.completion.response_ids == LetterTokenizer().encode(text)
        assert list(done.row.tokens) == [int(t) for t in expected(n, g)[: blocks * B]]
    assert sched.active_rows == 0 and sched.queue_length == 0


def test_streaming_sends_each_finished_block(sched):
    """A streaming job hears its text block by block (the blocks' texts add up to the whole response);
    a job cut by a stop string leaves after the block that shows it, the stop string not sent."""
    jobs = [Job(prompt=[3, 3, 3], gen_length=GEN, on_event=None, stream=True),
            Job(prompt=[3, 3, 3], gen_length=GEN, on_event=None, stream=True, stop=("cd",)),
            Job(prompt=[3, 3], gen_length=GEN, on_event=None, max_tokens=5)]
    events = run(sched, jobs)
    for i, kw in enumerate([{}, {"stop": "cd"}, {"max_tokens": 5}]):
        text, reason, blocks = want(len(jobs[i].prompt), **kw)
        *parts, done = events[i]
        assert done.kind == "done" and (done.text, done.completion.finish_reason) == (text, reason), i
        if not jobs[i].stream:
            assert parts == []  # a job that does not stream hears its answer once
            continue
        assert "".join(p.text for p in parts) == text and all(p.kind == "block" and p.text for p in parts)
        if i == 0:  # each block of 4 letters streamed as it finished (the EOS block's letters last)
            assert [p.text for p in parts] == [text[k:k + B] for k in range(0, len(text), B)]
        if i == 1:
            assert done.completion.nfe == blocks < want(3)[2]  # it left early


def test_bad_jobs_full_queue_cancel_and_stop(engine):
    s = Scheduler(engine, DCFG, max_batch=1, prompt_slot=SLOT, max_queue=2, sampling=False, batch_wait=0.0)
    for bad in ([], [3] * (SLOT + 1)):
        with pytest.raises(PolestarError):
            s.submit(Job(prompt=bad, gen_length=GEN, on_event=lambda e: None))
    with pytest.raises(PolestarError):
        s.submit(Job(prompt=[3], gen_length=6, on_event=lambda e: None))  # not a multiple of the block
    heard: list = []
    a = Job(prompt=[3], gen_length=GEN, on_event=heard.append)
    b = Job(prompt=[3], gen_length=GEN, on_event=heard.append)
    s.submit(a)
    s.submit(b)
    with pytest.raises(QueueFull):
        s.submit(Job(prompt=[3], gen_length=GEN, on_event=heard.append))
    a.cancel()  # a job cancelled while queued is never decoded
    s.start()
    deadline = threading.Event()
    for _ in range(600):
        if any(e.kind == "done" for e in heard):
            break
        deadline.wait(0.05)
    assert [e.kind for e in heard if e.kind != "block"] == ["done"] and heard[-1].text == want(1)[0]
    s.submit(Job(prompt=[3] * 4, gen_length=GEN, on_event=heard.append))
    s.stop()  # what is still queued or running hears an error; nothing is accepted after
    assert not s.running
    assert heard[-1].kind in ("done", "error")
    with pytest.raises(NotAccepting):
        s.submit(Job(prompt=[3], gen_length=GEN, on_event=heard.append))


def test_the_next_block_is_dispatched_before_the_last_is_read(engine):
    """With the overlap on, the host reads block k's result only after block k + 1 is on the device (its work
    overlaps the device's): one job of 4 blocks alone gives step, step, read, step, read, step, read, read;
    with it off, each block is read before the next is dispatched."""
    assert _order(engine, True) == ["step", "step", "read", "step", "read", "step", "read", "read"]
    assert _order(engine, False) == ["step", "read"] * 4


def test_the_overlap_pays_where_the_host_is_slower():
    """The automatic rule: ahead when the host's seconds per block exceed the finished fraction times the
    device's (a slot freed ahead idles one block), and reading each block at once until it has measured."""
    from polestar_jax.serving.scheduler import Overlap

    rule = Overlap()
    assert not rule.ahead()  # nothing measured yet: read each block at once
    for _ in range(20):
        rule.record(host=0.020, device=0.010, finished=0.5)  # a fast device, a busy host (a GPU)
    assert rule.ahead()
    for _ in range(20):
        rule.record(host=0.002, device=0.070, finished=0.4)  # a slow device, little host work (this CPU)
    assert not rule.ahead()
    assert Overlap(True).ahead() and not Overlap(False).ahead()


def _order(engine, overlap: bool) -> list[str]:
    s = Scheduler(engine, DCFG, max_batch=1, prompt_slot=SLOT, max_queue=2, sampling=False, batch_wait=0.0,
                  overlap=overlap)
    log, real_step = [], s.batch.step

    def step():
        pending, real_read = real_step(), None
        real_read = pending.read
        log.append("step")

        def read():
            log.append("read")
            return real_read()
        pending.read = read
        return pending

    s.batch.step = step
    s.start()
    try:
        events = run(s, [Job(prompt=[3], gen_length=GEN, on_event=None, stream=True)])
    finally:
        s.stop()
    assert events[0][-1].text == want(1)[0]
    return log
