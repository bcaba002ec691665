"""The OpenAI-compatible server, started for real on 127.0.0.1 with the bundled model, and spoken to with the
real ``openai`` client (streaming and not, completions and chat) and ``httpx`` (errors, metrics, health);
one test stops it with SIGTERM while a request is in flight. Its running batch runs its block starts and
steps in chunks of 2 rows (``--compact-rows 2``).

The server decodes with the checked dual cache (``--decoder fastdllm``: a short compile); every decoder's
exactness under load is tested without HTTP in ``tests/test_scheduler.py``.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from polestar_jax.api import load  # noqa: E402

ARGS = ["--decoder", "fastdllm", "--max-batch", "4", "--max-queue", "32", "--max-prompt-tokens", "64", "--compact-rows", "2"]
NAME = "tiny_tasks"


@pytest.fixture(scope="module")
def server(subprocess_env):
    """(base url, process) of a server on a free port; stopped (SIGKILL if need be) at the end."""
    proc = subprocess.Popen([sys.executable, "-m", "polestar_jax.serve", "--port", "0", *ARGS],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env)
    try:
        line = proc.stdout.readline()  # the ready line (after loading and compiling)
        m = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert m, f"no ready line: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        assert "batch 4 in chunks of 2," in line, line  # --compact-rows reached the running batch
        yield m.group(1), proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model():
    return load(compile_cache=False)  # (the suite runs without a persistent cache: conftest.py)


def _alone(model, ids, gen_length, seed=0):
    """The prompt ids decoded alone with the server's decoder (batch 1, a region of its own gen length)."""
    dc = model.decode_config(decoder="fastdllm", gen_length=gen_length)
    c = model.engine.completion(model.engine.run([ids], dc, seed=seed).row(0))
    return model.tokenizer.decode(c.response_ids)


def test_models_and_health(server):
    base, _ = server
    r = httpx.get(base + "/v1/models")
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [NAME]
    h = httpx.get(base + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ready"
    card = httpx.get(base + f"/v1/models/{NAME}")  # (the openai client's models.retrieve)
    assert card.status_code == 200 and card.json() == r.json()["data"][0]
    missing = httpx.get(base + "/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_models_retrieve_with_the_openai_client(client):
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_stream_and_completions_equal_the_prompt_alone(client, model):
    text = "reverse: jan,kat,leo,pat"
    ids = model.prompt_ids(text)
    want = _alone(model, ids, 32)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}])
    assert r.choices[0].message.content == want == "pat,leo,kat,jan"
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(model.tokenizer.encode(want))
    extra = r.model_extra["polestar"]
    assert extra["nfe"] >= extra["blocks"] >= 1 and extra["tpf"] > 0
    # streaming: one event per finished block (the answer spans 2 blocks of 8), then [DONE]
    chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}],
                                                 stream=True))
    parts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(parts) == want and len(parts) == 2
    assert chunks[-1].choices[0].finish_reason == "stop"
    # completions: the prompt as given (token ids here: the chat template's, so the same answer)
    c = client.completions.create(model=NAME, prompt=ids, max_tokens=16)
    assert c.choices[0].text == _alone(model, ids, 16) and c.object == "text_completion"
    s = list(client.completions.create(model=NAME, prompt=ids, max_tokens=16, stream=True))
    assert "".join(x.choices[0].text for x in s if x.choices) == c.choices[0].text


def test_completions_example_of_the_serving_page(server, model):
    """docs/serving.md's completions example (the chat template's rendering as the prompt) answers; the
    plain prompt it warns about gets the empty answer the page describes; the bundled folder gets the note."""
    from pathlib import Path

    from polestar_jax.serve import test_bed_note

    page = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    section = page.split("## Completions on a chat model", 1)[1]
    body = json.loads(re.search(r"-d '(\{.*?\})'", section).group(1))
    r = httpx.post(server[0] + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "pat,leo,kat,jan"
    plain = httpx.post(server[0] + "/v1/completions", json=dict(body, prompt="reverse: jan,kat,leo,pat"), timeout=120)
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == ""
    assert "test bed" in test_bed_note(model.path) and test_bed_note(str(Path(__file__).parent)) is None


def test_max_tokens_seed_and_stop(client, model):
    ids = model.prompt_ids("copy: jan,kat,leo,pat,rex")
    # max_tokens 5: decoded as gen length 8 (one block; the answer of a region of 8), cut at 5 ids
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=5)
    dc = model.decode_config(decoder="fastdllm", gen_length=8)
    want = model.engine.completion(model.engine.run([ids], dc).row(0), max_tokens=5)
    assert r.choices[0].text == model.tokenizer.decode(want.response_ids)
    assert r.usage.completion_tokens == len(want.response_ids) <= 5
    # max_completion_tokens: OpenAI's newer name for it (the chat API's); the same cut
    chat = [{"role": "user", "content": "copy: jan,kat,leo,pat,rex"}]
    a = client.chat.completions.create(model=NAME, messages=chat, max_completion_tokens=5)
    b = client.chat.completions.create(model=NAME, messages=chat, max_tokens=5)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == b.usage.completion_tokens <= 5
    r = client.completions.create(model=NAME, prompt=ids, stop=[",leo"])
    assert r.choices[0].text == "jan,kat" and r.choices[0].finish_reason == "stop"
    hot = [client.completions.create(model=NAME, prompt=ids, temperature=1.5, seed=s, max_tokens=8).choices[0].text
           for s in (1, 1, 2)]
    assert hot[0] == hot[1]  # a seed fixes the sampling noise


def test_concurrent_requests_of_mixed_lengths_are_exact(client, model):
    """20 concurrent requests (max_tokens 8..32, seeds 0..4) on 4 rows: each gets its tokens alone."""
    texts = ["reverse: jan,kat,leo,pat", "copy: rex,val,jan", "sort: pat,jan,kat", "remove 2: jan,kat,leo,pat,rex"]
    reqs = [(texts[i % 4], 8 * (1 + i % 4), i % 5) for i in range(20)]

    def ask(r):
        text, n, seed = r
        return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}],
                                              max_tokens=n, seed=seed).choices[0].message.content

    with cf.ThreadPoolExecutor(20) as ex:
        got = list(ex.map(ask, reqs))
    eng = model.engine  # alone: one row, its own generation length (a region of 32 with the rest hidden)
    dc = model.decode_config(decoder="fastdllm", gen_length=32)
    for (text, n, seed), g in zip(reqs, got):
        row = eng.run([model.prompt_ids(text)], dc, seed=seed, gen_lengths=[n]).row(0)
        ids = eng.completion(row, max_tokens=n).response_ids
        assert g == model.tokenizer.decode(ids), (text, n, seed)


BAD = {
    "malformed JSON": (b'{"model": "tiny_tasks", "prompt": ', 400, None),
    "wrong type": (json.dumps({"model": NAME, "prompt": "hi", "max_tokens": "ten"}), 400, "max_tokens"),
    "unknown model": (json.dumps({"model": "gpt-4", "prompt": "hi"}), 404, "model"),
    "empty prompt": (json.dumps({"model": NAME, "prompt": "   "}), 400, "prompt"),
    "over-long prompt": (json.dumps({"model": NAME, "prompt": list(range(5, 70))}), 400, "prompt"),
    "max_tokens 0": (json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 0}), 400, "max_tokens"),
    "max_tokens too large": (json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 33}), 400, "max_tokens"),
    "max_completion_tokens too large": (json.dumps({"model": NAME, "prompt": "hi", "max_completion_tokens": 33}), 400,
                                        "max_completion_tokens"),
    "max_tokens disagree": (json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 8, "max_completion_tokens": 16}),
                            400, "max_completion_tokens"),
    "n 2": (json.dumps({"model": NAME, "prompt": "hi", "n": 2}), 400, "n"),
    "top_p": (json.dumps({"model": NAME, "prompt": "hi", "top_p": 0.5}), 400, "top_p"),
    "logprobs 0": (json.dumps({"model": NAME, "prompt": "hi", "logprobs": 0}), 400, "logprobs"),  # (0 == False)
    "early_threshold": (json.dumps({"model": NAME, "prompt": "hi", "early_threshold": 0.5}), 400, "early_threshold"),
    "negative temperature": (json.dumps({"model": NAME, "prompt": "hi", "temperature": -1}), 400, "temperature"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_requests_get_openai_errors(server, name):
    body, status, param = BAD[name]
    r = httpx.post(server[0] + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "\n" not in err["message"] and err["type"] and err["param"] == param


def test_neutral_openai_fields_are_accepted(server):
    """OpenAI's optional fields at their neutral values (what some clients always send) are a plain request."""
    body = {"model": NAME, "prompt": "copy: jan", "max_tokens": 8, "top_p": 1, "frequency_penalty": 0.0,
            "presence_penalty": 0, "logprobs": None, "echo": False, "best_of": 1, "logit_bias": {}}
    r = httpx.post(server[0] + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    chat = {"model": NAME, "max_tokens": 8, "logprobs": False, "response_format": {"type": "text"}, "tools": [],
            "messages": [{"role": "user", "content": "copy: jan"}]}
    r = httpx.post(server[0] + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text


def test_chat_errors(server):
    r = httpx.post(server[0] + "/v1/chat/completions", json={"model": NAME, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = httpx.post(server[0] + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user"}]})
    assert r.status_code == 400


def _gauge(text: str, name: str) -> float:
    """The value of the unlabelled series ``name`` in the Prometheus ``text``."""
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_disconnect_frees_the_row_and_metrics(server, client):
    base, _ = server
    ids = list(range(5, 60))  # a prompt the model never saw: it runs to its last block
    with httpx.stream("POST", base + "/v1/completions", json={"model": NAME, "prompt": ids, "stream": True},
                      timeout=60) as r:
        next(r.iter_lines())  # the first block arrived; then the client goes away
    deadline = time.time() + 30
    m = ""
    while time.time() < deadline:
        m = httpx.get(base + "/metrics").text
        if re.search(r'polestar_requests_total\{outcome="cancelled"\} [1-9]', m) or \
                re.search(r"^polestar_active_rows 0\.0$", m, re.M):
            break
        time.sleep(0.1)
    assert re.search(r"^polestar_active_rows 0\.0$", m, re.M), m
    calls, rows = _gauge(m, "polestar_block_calls_total"), _gauge(m, "polestar_row_blocks_total")
    assert 1 <= calls <= rows <= 4 * calls  # every call decodes 1 to max_batch rows
    for name in ("polestar_requests_total", "polestar_queue_length", "polestar_completion_tokens_total",
                 "polestar_forwards_total", "polestar_tokens_per_forward",
                 "polestar_time_to_first_block_seconds_bucket", "polestar_request_latency_seconds_bucket"):
        assert name in m, name
    assert re.search(r'polestar_requests_total\{outcome="ok"\} [1-9]', m)
    assert re.search(r'polestar_requests_total\{outcome="bad_request"\} [1-9]', m)


def test_the_scheduler_builds_one_running_batch(model, monkeypatch):
    """At start the server's scheduler builds its one running batch (which compiles its programs), not a
    throw-away batch to compile and then another; its compile records are that batch's."""
    from polestar_jax.engine import engine as engine_mod
    from polestar_jax.serving.scheduler import Scheduler

    built = []
    real = engine_mod.RunningBatch.__init__
    monkeypatch.setattr(engine_mod.RunningBatch, "__init__", lambda self, *a, **k: (built.append(self),
                                                                                    real(self, *a, **k))[1])
    dcfg = model.decode_config(decoder="fastdllm", gen_length=32)
    sched = Scheduler(model.engine, dcfg, max_batch=4, prompt_slot=64, compact_rows=2)
    assert built == [sched.batch] and sched.batch.spec.compact_rows == 2
    assert all(r in model.engine.compile_records for r in sched.compiled)


def test_full_queue_is_429_with_retry_after(model):
    """The HTTP mapping of a full queue, on the app with a scheduler whose queue is full (the queue itself is
    tested in tests/test_scheduler.py)."""
    from fastapi.testclient import TestClient

    from polestar_jax.serving.scheduler import QueueFull
    from polestar_jax.serving.app import ServerLimits, create_app

    class Full:
        dcfg = model.decode_config(decoder="fastdllm")
        max_batch, queue_length, active_rows, running, metrics = 4, 8, 4, True, None

        def submit(self, job):
            raise QueueFull("the queue is full (8 requests waiting)")

    app = create_app(model, Full(), ServerLimits(64, 32, 8), NAME)
    with TestClient(app) as tc:
        r = tc.post("/v1/completions", json={"model": NAME, "prompt": "copy: jan"})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"


def _process(pid: int) -> tuple[int, int, int]:
    """(resident KiB, threads, open file descriptors) of process ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        status = f.read()
    get = lambda key: int(re.search(rf"^{key}:\s+(\d+)", status, re.M).group(1))
    return get("VmRSS"), get("Threads"), len(os.listdir(f"/proc/{pid}/fd"))


def _requests(base: str, n: int, offset: int) -> int:
    """``n`` requests from 8 client threads (twice the server's batch: a queue forms): streaming chat,
    plain completions, some with a stop string, and every 10th a stream the client drops at once (the cancel
    path). Returns how many answered 200 (a stream read to its end: and ended with ``[DONE]``)."""
    tasks = ["copy: jan,kat,leo", "reverse: ann,bob,cal,dan", "remove: x from ax,bx,cx", "copy: pat,sam"]

    def one(i):
        prompt = tasks[i % len(tasks)] + f",{chr(97 + i % 26)}{chr(97 + (i // 26) % 26)}"
        with httpx.Client(base_url=base, timeout=120) as h:
            if i % 10 == 0:  # a stream the client drops once its headers came (queued or decoding: cancelled)
                with h.stream("POST", "/v1/completions", json={
                        "model": NAME, "prompt": list(range(5, 40 + i % 20)), "stream": True}) as r:
                    return r.status_code
            if i % 3 == 1:
                with h.stream("POST", "/v1/chat/completions", json={
                        "model": NAME, "stream": True, "max_tokens": 16,
                        "messages": [{"role": "user", "content": prompt}]}) as r:
                    lines = [x for x in r.iter_lines() if x]
                    return r.status_code if lines[-1] == "data: [DONE]" else -1
            body = {"model": NAME, "prompt": prompt, "max_tokens": 8 * (1 + i % 3), "seed": i}
            if i % 4 == 0:
                body["stop"] = [","]
            return h.post("/v1/completions", json=body).status_code

    with cf.ThreadPoolExecutor(8) as ex:
        return sum(code == 200 for code in ex.map(one, range(offset, offset + n)))


def _cancelled(text: str) -> float:
    m = re.search(r'^polestar_requests_total\{outcome="cancelled"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _settled(base: str, timeout: float = 30.0) -> str:
    """The server's metrics once nothing is queued or running (at most ``timeout`` seconds)."""
    end = time.monotonic() + timeout
    while True:
        m = httpx.get(base + "/metrics").text
        if (_gauge(m, "polestar_active_rows") == 0 and _gauge(m, "polestar_queue_length") == 0) or \
                time.monotonic() > end:
            return m
        time.sleep(0.1)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc")
def test_a_thousand_requests_leave_memory_threads_and_sockets_where_they_were(server):
    """Over 1,000 requests (streaming and not, stop strings, dropped streams) after a warm-up of 100: the
    server's threads and open descriptors return to their count, its resident memory stays within a few
    percent (the allocator's arenas may take one step), nothing stays queued or running, and dropped
    streams were cancelled."""
    base, proc = server
    assert _requests(base, 100, 0) == 100
    before = _settled(base)
    rss0, threads0, fds0 = _process(proc.pid)
    assert _requests(base, 1000, 100) == 1000
    m = _settled(base)
    end = time.monotonic() + 30
    while True:  # the clients' sockets close on the server's side a moment after they do
        rss1, threads1, fds1 = _process(proc.pid)
        if (threads1 == threads0 and fds1 <= fds0) or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert _gauge(m, "polestar_active_rows") == 0 and _gauge(m, "polestar_queue_length") == 0, m
    assert threads1 == threads0 and fds1 <= fds0, (threads0, threads1, fds0, fds1)
    assert rss1 <= rss0 * 1.08, (rss0, rss1)
    assert _cancelled(m) > _cancelled(before), m  # (some of the 100 dropped streams were still queued or decoding)


def test_sigterm_drains_in_flight_requests_and_exits_0(server, model):
    base, proc = server
    ids = list(range(5, 60))
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(lambda: httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": ids},
                                           timeout=60))
        deadline = time.time() + 30
        while time.time() < deadline and "polestar_active_rows 1.0" not in httpx.get(base + "/metrics").text:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        r = fut.result()
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert proc.wait(60) == 0
    with pytest.raises(httpx.TransportError):
        httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "copy: jan"}, timeout=5)
    assert np.isfinite(r.json()["polestar"]["tpf"])


@pytest.mark.parametrize("argv, part", [
    (["--compact-rows", "-1"], "--compact-rows must be >= 0"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--max-queue", "0"], "--max-queue must be >= 1"),
    (["--batch-wait", "1.5"], "--batch-wait must be in [0, 1]"),
    (["--decoder", "fastdllm", "--no-refresh"], "--no-refresh applies to decoder polestar only"),  # (as given)
    (["--api-key", " "], "--api-key must be a non-empty word"),
    # a gen length past the model's length is --max-tokens's fault, not a flag the user never passed
    (["--max-tokens", "300"], "--max-tokens 300 decodes 304 tokens (whole blocks of 8), which leaves no room for "
                              "a prompt in the model's max_sequence_length 256"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be >= 1, got 0"),
    (["--max-tokens", "128", "--max-prompt-tokens", "129"], "--max-prompt-tokens 129 + gen length 128 exceeds"),
])
def test_bad_server_options_are_one_line(argv, part, capsys, offline_session_cache):
    """A bad server option: exit 2 with one error line naming the flag as given (before anything compiles)."""
    from polestar_jax import serve

    code = serve.main(["--port", "0", *argv])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and part in err, (code, err)


def _gate_client(api_key=None):
    """(the Gate middleware over a small app, the Api parts it uses) for the tests below: the real server's
    window between SIGTERM and the closed socket is too short to hit reliably, and a key needs its own server."""
    from fastapi import FastAPI

    from polestar_jax.serving.app import Api, Gate
    from polestar_jax.serving.metrics import Metrics

    inner = FastAPI()
    inner.post("/v1/completions")(lambda: {"ok": True})
    inner.get("/v1/models")(lambda: {"ok": True})
    inner.get("/health")(lambda: {"ok": True})
    api = Api.__new__(Api)  # (the parts the middleware uses: the flag, the metrics, the error object)
    api.draining, api.metrics = False, Metrics()
    transport = httpx.ASGITransport(app=Gate(inner, api, api_key))
    return api, lambda: httpx.AsyncClient(transport=transport, base_url="http://t")


def test_draining_refuses_new_requests_with_503():
    """While draining, every POST is a 503 with an OpenAI error object (and counted as rejected); GETs
    (health, metrics) still answer."""
    import asyncio

    api, client = _gate_client()

    async def talk():
        async with client() as c:
            before = (await c.post("/v1/completions")).status_code
            api.draining = True
            return before, await c.post("/v1/completions"), (await c.get("/health")).status_code

    before, refused, health = asyncio.run(talk())
    assert before == 200 and health == 200
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
    assert b'polestar_requests_total{outcome="rejected"} 1.0' in api.metrics.render()


def test_api_key_guards_the_v1_endpoints():
    """With --api-key, /v1/ needs the bearer token (the openai client's api_key): else 401 with OpenAI's
    invalid_api_key error; /health stays open."""
    import asyncio

    api, client = _gate_client("s3cret")

    async def talk():
        async with client() as c:
            good = {"Authorization": "Bearer s3cret"}
            return [(await c.post("/v1/completions")).status_code,
                    (await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})),
                    (await c.post("/v1/completions", headers=good)).status_code,
                    (await c.get("/v1/models", headers=good)).status_code,
                    (await c.get("/health")).status_code]

    none, wrong, post, get, health = asyncio.run(talk())
    assert none == 401 and wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert (post, get, health) == (200, 200, 200)
    assert b'polestar_requests_total{outcome="unauthorized"} 2.0' in api.metrics.render()


@pytest.mark.parametrize("decoder", ["polestar", "polestar_v"])
def test_both_polestar_decoders_take_their_compiled_early_threshold(decoder):
    """``early_threshold`` is compiled into a Polestar server's executable, LLaDA-V's Polestar included: a
    request may name that value (not another), and its ``threshold`` must stay above it (else the early
    commits, which take confidences between the two, could never fire)."""
    from polestar_jax.config import DecodeConfig, PolestarConfig
    from polestar_jax.serving.app import BadRequest, ChatRequest, ServerLimits, check_fields

    dcfg = DecodeConfig(decoder=decoder, cache="prefix" if decoder == "polestar_v" else "dual", gen_length=16,
                        block_length=8, threshold=0.9, polestar=PolestarConfig(early_threshold=0.6))
    limits = ServerLimits(max_prompt_tokens=64, max_tokens=16, block_length=8)

    def check(**more):
        req = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], **more)
        return check_fields(req, "m", limits, dcfg, 0.0)

    assert check(early_threshold=0.6, threshold=0.8)["threshold"] == 0.8
    for more, field in (({"early_threshold": 0.5}, "early_threshold"), ({"threshold": 0.6}, "threshold")):
        with pytest.raises(BadRequest) as e:
            check(**more)
        assert e.value.param == field
