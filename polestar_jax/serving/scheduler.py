"""Continuous batching at block granularity: the loop a server runs on one :class:`RunningBatch`.

A :class:`Scheduler` owns one running batch of an :class:`~polestar_jax.engine.engine.Engine` (one decode structure,
``max_batch`` slots, one prompt slot) and a bounded queue of :class:`Job` s. Its thread repeats: put waiting
jobs into free slots (at a block boundary), advance every live row by one block, report each job's newly
finished block (streaming), and hand back the rows that are done (their last block, early exit, a stop
string, or a client that went away). A job's tokens depend only on its prompt, its settings and its seed,
never on what else is decoding (the engine's rows are independent), so the server is exact under load.

Every result reaches a job through its ``on_event`` callback (called on the scheduler thread): a web server
forwards it to the request's event loop. Nothing here knows about HTTP.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, Optional, Sequence

from polestar_jax.config import BATCH_WAIT, DecodeConfig
from polestar_jax.engine.engine import Completion, Engine, RowOutput, RunningBatch
from polestar_jax.engine.snapshot import BlockResult
from polestar_jax.errors import PolestarError


class QueueFull(PolestarError):
    """The scheduler's queue holds ``max_queue`` jobs already."""


class NotAccepting(PolestarError):
    """The scheduler is draining (shutting down) or stopped."""


@dataclasses.dataclass
class Event:
    """What a job hears from the scheduler: ``kind`` is "block" (``text``: new response text of a finished
    block), "done" (``completion``, ``text``: the whole response) or "error" (``message``)."""

    kind: str
    text: str = ""
    completion: Optional[Completion] = None
    row: Optional[RowOutput] = None
    message: str = ""


@dataclasses.dataclass
class Job:
    """One request: prompt ids, its generation length (a multiple of the block length), the response cut
    (``max_tokens`` ids, ``stop`` strings), its seed and per-row knobs, and the callback that receives its
    :class:`Event` s."""

    prompt: Sequence[int]
    gen_length: int
    on_event: Callable[[Event], None]
    max_tokens: Optional[int] = None
    stop: tuple = ()
    seed: int = 0
    temperature: Optional[float] = None
    threshold: Optional[float] = None
    stream: bool = False
    id: int = dataclasses.field(default_factory=itertools.count().__next__)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_block: Optional[float] = None
    cancelled: bool = False
    sent: str = ""  # response text streamed so far
    slot: Optional[int] = None
    #: LLaDA-V: the prompt's image rows [R, D] that its local ids name (:mod:`polestar_jax.engine.images`)
    images: Any = None

    def cancel(self) -> None:
        """The client went away: the row leaves at the next block boundary (thread-safe: a flag)."""
        self.cancelled = True


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest occurrence of any stop string; and whether one occurred."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def check_settings(max_batch: int, max_queue: int, batch_wait: float, name: Callable[[str], str] = str) -> None:
    """Raises :class:`PolestarError` for a scheduler setting out of range; ``name`` maps a setting's name to
    what the message calls it (the server: its flag)."""
    for key, value in (("max_batch", max_batch), ("max_queue", max_queue)):
        if value < 1:
            raise PolestarError(f"{name(key)} must be >= 1, got {value}")
    if not 0.0 <= batch_wait <= 1.0:
        raise PolestarError(f"{name('batch_wait')} must be in [0, 1] (a fraction of a block call), got {batch_wait}")


@dataclasses.dataclass
class Overlap:
    """Whether the scheduler dispatches the next block before it reads the last one (:meth:`Scheduler._loop`).

    Dispatching ahead hides the host's work on a block behind the device's next block, but a slot the block
    frees idles one block longer. It is worth it when the host's seconds per block exceed what the idling
    costs: the fraction of rows a block finishes times the block's device seconds (a fast device and a
    detokenizing, streaming host: a GPU; a slow device and little host work, short answers: this CPU with
    the test beds). ``mode``: True or False fixes the choice; None (auto) decides from moving averages of
    the measured seconds (it starts reading each block at once, which measures the device's time)."""

    mode: Optional[bool] = None
    host: float = 0.0  # host seconds a block's result costs (reporting it)
    device: float = 0.0  # device seconds a block costs
    finished: float = 0.0  # fraction of its rows a block finishes
    alpha: float = 0.3

    def ahead(self) -> bool:
        return self.mode if self.mode is not None else self.host > self.finished * self.device

    def record(self, host: float, device: float, finished: float) -> None:
        a = self.alpha
        self.host, self.device = (1 - a) * self.host + a * host, (1 - a) * self.device + a * device
        self.finished = (1 - a) * self.finished + a * finished


class Scheduler:
    """The continuous-batching loop over one running batch (see the module docstring).

    engine, dcfg:   the engine and the decode structure every job runs with (its gen length is the most a
                    job may ask for; per-job temperature and threshold are traced knobs)
    max_batch:      slots decoding at once;  prompt_slot: the longest prompt (tokens) a job may have
    max_queue:      jobs waiting for a slot at most (:class:`QueueFull` beyond)
    sampling:       compile the sampling variant (any per-job temperature, 0 included, gives the tokens the
                    greedy or sampling decoder gives alone)
    metrics:        optional callbacks: ``metrics(name, value)`` for "forwards" (of each finished job), "tokens",
                    "non_eos", "active", "queue", "block" (a block call ran; value: the rows it decoded),
                    "first_block" (seconds), "latency" (seconds), "outcome" (a string)
    compact_rows:   the running batch's step chunk (:class:`RunningBatch`; None: automatic)
    batch_wait:     after rows finish, wait at most this fraction of the last block call for new jobs to fill
                    their slots before the next block (0: never; a closed-loop client sends its next request
                    right after an answer, and a slot left empty idles for a whole block)
    overlap:        dispatch each block before reading the last (True), never (False) or when it pays (None:
                    measured, :class:`Overlap`)
    """

    def __init__(self, engine: Engine, dcfg: DecodeConfig, max_batch: int, prompt_slot: int, max_queue: int = 256,
                 sampling: bool = True, metrics: Optional[Callable[[str, Any], None]] = None,
                 compact_rows: Optional[int] = None, batch_wait: float = BATCH_WAIT, overlap: Optional[bool] = None):
        check_settings(max_batch, max_queue, batch_wait)
        self.engine, self.dcfg = engine, dcfg
        self.max_batch, self.prompt_slot, self.max_queue = int(max_batch), int(prompt_slot), int(max_queue)
        self.sampling, self.compact_rows = sampling, compact_rows
        self.batch_wait = float(batch_wait)
        self.overlap = Overlap(overlap)
        self.metrics = metrics or (lambda name, value: None)
        t0, n0 = time.perf_counter(), engine.compiles
        self.batch = self._new_batch()  # the one running batch: building it compiles (or loads) its programs
        new = engine.compiles - n0
        self.compiled = list(engine.compile_records)[-new:] if new else []  # their records
        self.compile_seconds = time.perf_counter() - t0
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._accepting = True
        self._stop = False
        self._jobs: dict[int, Job] = {}  # slot -> job
        self._thread = threading.Thread(target=self._loop, name="polestar-scheduler", daemon=True)
        self.blocks_run = 0

    def _new_batch(self) -> RunningBatch:
        return RunningBatch(self.engine, self.dcfg, self.max_batch, self.prompt_slot, sampling=self.sampling,
                            compact_rows=self.compact_rows)

    # ------------------------------------------------------------------------------------ control
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def active_rows(self) -> int:
        return len(self._jobs)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def check(self, job: Job) -> None:
        """Raises :class:`PolestarError` for a job the running batch would refuse (the serving layer's one
        check, on the submitting thread, so that a bad job never reaches the loop): a prompt longer than the
        prompt slot, empty or with ids outside the vocabulary (:meth:`Engine.check`), a gen length that is not
        a positive multiple of the block length up to the batch's (:meth:`RunningBatch.check`)."""
        if len(job.prompt) > self.prompt_slot:
            raise PolestarError(f"the prompt has {len(job.prompt)} tokens; this server takes at most "
                                f"{self.prompt_slot}")
        self.batch.check(job.prompt, job.gen_length, 0 if job.images is None else int(job.images.shape[0]))

    def submit(self, job: Job) -> None:
        """Queues ``job``; raises :class:`QueueFull` or :class:`NotAccepting`. The job is checked first
        (:meth:`check`): a :class:`PolestarError` names what is wrong."""
        self.check(job)
        with self._cv:
            if not self._accepting:
                raise NotAccepting("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self._queue.append(job)
            self.metrics("queue", len(self._queue))
            self._cv.notify()

    def drain(self, timeout: float) -> bool:
        """Stops accepting jobs and waits until every queued and running job is done (at most ``timeout``
        seconds); returns whether all finished."""
        with self._cv:
            self._accepting = False
            self._cv.notify()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self._queue and not self._jobs:
                return True
            time.sleep(0.02)
        return not self._queue and not self._jobs

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the loop: jobs still queued or running get an error event; the thread is joined."""
        with self._cv:
            self._accepting = False
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for job in list(self._queue) + list(self._jobs.values()):
            job.on_event(Event("error", message="the server stopped"))
        self._queue.clear()
        self._jobs.clear()

    # ------------------------------------------------------------------------------------ the loop
    def _admit(self) -> None:
        """Queued jobs into free slots (cancelled ones are dropped)."""
        while self._queue and self.batch.free_slots:
            with self._cv:
                job = self._queue.popleft() if self._queue else None
            if job is None:
                break
            if job.cancelled:
                self.metrics("outcome", "cancelled")
                continue
            job.slot = self.batch.insert(job.prompt, seed=job.seed, row=0, tag=job.id, gen_length=job.gen_length,
                                         checked=True, images=job.images,
                                         temperature=job.temperature, threshold=job.threshold)
            self._jobs[job.slot] = job
        self.metrics("queue", len(self._queue))
        self.metrics("active", len(self._jobs))

    def _await_arrivals(self, finished: int, block_seconds: float) -> None:
        """After ``finished`` rows left the batch: wait at most ``batch_wait`` x the last block call's seconds
        for new jobs to fill the freed slots before the next block (a client that got its answer often sends its
        next request at once; a slot filled now decodes a whole block sooner)."""
        deadline = time.monotonic() + self.batch_wait * block_seconds
        want = min(finished, len(self.batch.free_slots), self.max_queue)
        with self._cv:
            while len(self._queue) < want and self._accepting and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)

    def _loop(self) -> None:
        """Admit, dispatch the next block, read what a block left. With the overlap on (:class:`Overlap`) the
        next block is dispatched before the last one is read: the host's work on block ``k`` (progress,
        detokenizing, stop strings, events, freeing rows) runs while the device computes block ``k + 1``, so a
        block call costs the larger of the two, not their sum; a slot freed by block ``k`` then takes a new row
        before block ``k + 2``, and a row that a stop string ends decodes one block more on the device,
        discarded (rows are independent: no other row's tokens change)."""
        finished, block_seconds, pending = 0, 0.0, None
        while True:
            with self._cv:
                while not self._stop and not self._queue and not self._jobs and pending is None:
                    finished = 0  # (idle: the rows that left are not coming back now)
                    self._cv.wait(0.5)
                if self._stop:
                    return
            try:
                if finished and self.batch_wait > 0:
                    self._await_arrivals(finished, block_seconds)
                self._admit()
                self._drop_cancelled()
                t0, rows, ahead = time.perf_counter(), len(self._jobs), self.overlap.ahead()
                nxt = None
                if self.batch.max_blocks_left() > 0:  # some row still has a block to decode
                    nxt = self.batch.step()
                    self.blocks_run += 1
                    self.metrics("block", rows)
                reads = [p for p in (pending, None if ahead else nxt) if p is not None]
                pending = nxt if ahead else None
                for p in reads:
                    self._read(p, rows, ahead and p is not nxt)
                finished, block_seconds = rows - len(self._jobs), time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - a failed step fails its batch, not the server
                pending = None
                self._fail_batch(f"{type(e).__name__}: {e}")

    def _read(self, pending, rows: int, overlapped: bool) -> None:
        """Reads a dispatched block's result and reports it, timing both for :class:`Overlap`."""
        t0, before = time.perf_counter(), len(self._jobs)
        res = pending.read()
        t1 = time.perf_counter()
        self._report(res)
        host = time.perf_counter() - t1
        self.overlap.record(host, (t1 - t0) + (host if overlapped else 0.0), (before - len(self._jobs)) / max(1, rows))

    def _drop_cancelled(self) -> None:
        for slot, job in list(self._jobs.items()):
            if job.cancelled:
                self.batch.cancel(slot)
                del self._jobs[slot]
                self.metrics("outcome", "cancelled")

    def _fail_batch(self, message: str) -> None:
        for job in self._jobs.values():
            job.on_event(Event("error", message=f"decoding failed: {message}"))
            self.metrics("outcome", "error")
        self._jobs.clear()
        self.batch = self._new_batch()  # a fresh state (its programs are the engine's: no recompile)

    def _report(self, res: BlockResult) -> None:
        """After a block (``res``, read on the host): stream newly finished blocks and finish the rows that are
        done (their last block, early exit, or a stop string in their text). Slots whose row was admitted or
        freed after ``res``'s block was dispatched are not its rows and are left alone."""
        now, B = time.perf_counter(), self.dcfg.block_length
        for s, job in list(self._jobs.items()):
            if not self.batch.holds(res, s):
                continue
            n = int(res.blocks[s])
            if res.done[s]:
                self._finish(job, self.batch.rows_of(res, [s])[0], now)
                continue
            if not (job.stream or job.stop) or n == 0:
                continue
            self._first_block(job, now)
            text, hit = self._text(job, res.tokens[s, : n * B])
            if hit:  # a stop string ended the response: the row leaves now
                self._finish(job, self.batch.rows_of(res, [s])[0], now)
                continue
            if job.stream:
                held = max((len(x) for x in job.stop), default=1) - 1  # a stop string may still complete
                safe = text[: max(len(job.sent), len(text) - held)]
                if len(safe) > len(job.sent):
                    job.on_event(Event("block", text=safe[len(job.sent):]))
                    job.sent = safe
        self.metrics("active", len(self._jobs))

    def _finish(self, job: Job, row: RowOutput, now: float) -> None:
        del self._jobs[job.slot]
        self._first_block(job, now)
        completion = self.engine.completion(row, job.max_tokens)
        text, hit = self._text(job, row.tokens)
        if hit:  # cut at a stop string: the response is that text
            ids = self.engine.tokenizer.encode(text)
            completion = dataclasses.replace(completion, finish_reason="stop", response_ids=ids)
        if job.stream and len(text) > len(job.sent):
            job.on_event(Event("block", text=text[len(job.sent):]))
            job.sent = text
        self.metrics("tokens", len(completion.response_ids))
        self.metrics("non_eos", completion.non_eos_tokens)
        self.metrics("forwards", completion.nfe)
        self.metrics("latency", now - job.submitted)
        self.metrics("outcome", "ok")
        job.on_event(Event("done", text=text, completion=completion, row=row))

    def _first_block(self, job: Job, now: float) -> None:
        if job.first_block is None:
            job.first_block = now
            self.metrics("first_block", now - job.submitted)

    def _text(self, job: Job, tokens) -> tuple[str, bool]:
        """The response text of ``tokens`` (cut at the first stop token, ``max_tokens`` and the stop strings)."""
        ids, _ = self.engine.response_ids(tokens, job.max_tokens)
        return cut_at_stop(self.engine.tokenizer.decode(ids), job.stop)
