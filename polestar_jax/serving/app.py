"""The OpenAI-compatible HTTP application of :mod:`polestar_jax.serve`: request models (pydantic), their
checks, the request handling over a :class:`polestar_jax.serving.scheduler.Scheduler`, the response objects
(OpenAI's completion, chat completion and their stream chunks) and the FastAPI app (see ``docs/serving.md``).
Needs the ``serve`` extra (FastAPI, pydantic, prometheus-client)."""
# (no "from __future__ import annotations": FastAPI reads the request models from real annotations)
import asyncio
import dataclasses
import hmac
import json
import math
import time
import uuid
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from polestar_jax.config import POLESTAR_DECODERS, DecodeConfig
from polestar_jax.errors import PolestarError

#: Fields OpenAI defines that this server accepts only at their neutral value (anything else: 400). Compared
#: with their type (``logprobs: 0`` asks the completions API for the chosen tokens' log probabilities).
NEUTRAL = {"top_p": (None, 1, 1.0), "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
           "logprobs": (None, False), "top_logprobs": (None, 0, 0.0), "echo": (None, False),
           "best_of": (None, 1, 1.0), "logit_bias": (None, {}), "suffix": (None, ""), "response_format": (None, {"type": "text"}),
           "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, False, True),
           "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default")}


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What a request may ask: prompt tokens, max_tokens, the block length (for rounding)."""

    max_prompt_tokens: int
    max_tokens: int
    block_length: int
    #: LLaDA-V: the folder ``file://`` image URLs may be read from (None: data: URLs only)
    image_dir: Optional[str] = None


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


# ------------------------------------------------------------------------------------------ requests


class Common(BaseModel):
    """The fields of both endpoints (OpenAI's, plus Polestar's ``threshold`` / ``early_threshold``)."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name for max_tokens (the chat API's)
    temperature: Optional[float] = Field(default=None, ge=0.0)
    seed: Optional[int] = Field(default=None, ge=0, lt=2 ** 32)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[dict] = None
    n: int = 1
    user: Optional[str] = None
    threshold: Optional[float] = Field(default=None, ge=0.0, le=1.0)  # Polestar / Fast-dLLM: a traced knob
    early_threshold: Optional[float] = None  # Polestar: compiled in; must equal the server's


class CompletionRequest(Common):
    prompt: Union[str, list[str], list[int]]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict], None] = None


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)


class BadRequest(Exception):
    """A request the server cannot take: ``status`` 400 (or 404 for an unknown model) and the field."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_body(message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
               code: Optional[str] = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def unknown_model(name: str, served_name: str) -> str:
    """The message of a request (or a model card) naming another model than the served one."""
    return f"the model '{name}' does not exist (this server serves '{served_name}')"


def check_fields(req: Common, served_name: str, limits: "ServerLimits", dcfg: DecodeConfig,
                 default_temperature: float) -> dict:
    """The request's job settings (:class:`polestar_jax.serving.scheduler.Job` fields); :class:`BadRequest` for what
    the server cannot honour."""
    if req.model != served_name:
        raise BadRequest(unknown_model(req.model, served_name), "model", 404)
    if req.n != 1:
        raise BadRequest("n must be 1 (one choice per request)", "n")
    for name, value in (req.model_extra or {}).items():
        if name not in NEUTRAL:
            raise BadRequest(f"unknown field '{name}'", name)
        if not any(type(value) is type(v) and value == v for v in NEUTRAL[name]):
            raise BadRequest(f"'{name}' is not supported (only its default, {NEUTRAL[name][-1]!r})", name)
    asked = {v for v in (req.max_tokens, req.max_completion_tokens) if v is not None}
    if len(asked) > 1:
        raise BadRequest("max_tokens and max_completion_tokens disagree (give one)", "max_completion_tokens")
    max_tokens = asked.pop() if asked else limits.max_tokens
    if not 1 <= max_tokens <= limits.max_tokens:
        field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        raise BadRequest(f"{field} must be between 1 and {limits.max_tokens}, got {max_tokens}", field)
    pc, polestar = dcfg.polestar, dcfg.decoder in POLESTAR_DECODERS
    if req.early_threshold is not None and (not polestar or req.early_threshold != pc.early_threshold):
        raise BadRequest(f"early_threshold is compiled into this server's executable "
                         f"({pc.early_threshold if polestar else 'decoder ' + str(dcfg.decoder)}); start the "
                         "server with --early-threshold to change it", "early_threshold")
    if req.threshold is not None and dcfg.rule != "threshold":
        raise BadRequest(f"threshold: this server's decoder ({dcfg.decoder}, {dcfg.rule} rule) has no confidence "
                         "threshold", "threshold")
    if req.threshold is not None and polestar and pc.early_threshold is not None and req.threshold <= pc.early_threshold:
        raise BadRequest(f"threshold must be above the server's early_threshold {pc.early_threshold}", "threshold")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > 4 or any(not s for s in stop):
        raise BadRequest("stop: at most 4 non-empty strings", "stop")
    return dict(max_tokens=max_tokens, gen_length=round_up(max_tokens, limits.block_length), stop=stop,
                seed=0 if req.seed is None else req.seed, stream=req.stream, threshold=req.threshold,
                temperature=default_temperature if req.temperature is None else req.temperature)


def prompt_ids(model, req: Union[CompletionRequest, ChatRequest]) -> list[int]:
    """The request's prompt ids: chat messages through the folder's chat template, a completion prompt as
    given (text or token ids); :class:`BadRequest` for an empty or malformed one."""
    tok = model.tokenizer
    if isinstance(req, ChatRequest):
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # content parts: text only
                if any(p.get("type") != "text" for p in content):
                    raise BadRequest("messages: only text content is supported", "messages")
                content = "".join(str(p.get("text", "")) for p in content)
            messages.append({"role": m.role, "content": content or ""})
        if not any(m["content"].strip() for m in messages):
            raise BadRequest("messages: the conversation is empty", "messages")
        try:
            text = tok.apply_chat_template(messages) if tok.chat_template else "\n".join(
                m["content"] for m in messages)
        except PolestarError as e:
            raise BadRequest(f"messages: {e}", "messages") from None
        return tok.encode(text)
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        if len(p) != 1:
            raise BadRequest("prompt: one prompt per request", "prompt")
        p = p[0]
    if isinstance(p, str):
        if not p.strip():
            raise BadRequest("prompt: the prompt is empty", "prompt")
        return tok.encode(p)
    if not p:
        raise BadRequest("prompt: the prompt is empty", "prompt")
    if any(not isinstance(x, int) or x < 0 or x >= model.config.embedding_size for x in p):
        raise BadRequest(f"prompt: token ids must be integers in [0, {model.config.embedding_size})", "prompt")
    return list(p)


# ------------------------------------------------------------------------------------------ the app
class Api:
    """The request handling of one server: a model, its started scheduler, the limits and the metrics."""

    def __init__(self, model, scheduler, limits: "ServerLimits", served_name: str, default_temperature: float):
        from polestar_jax.serving.metrics import Metrics

        self.model, self.scheduler, self.limits, self.served = model, scheduler, limits, served_name
        self.default_temperature = default_temperature
        self.metrics = Metrics()
        scheduler.metrics = self.metrics.record
        self.draining = False

    def error(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
              headers: Optional[dict] = None, code: Optional[str] = None):
        from fastapi.responses import JSONResponse

        return JSONResponse(error_body(message, param, kind, code), status_code=status, headers=headers)

    async def run(self, request, req, chat: bool):
        """One request: submitted to the scheduler, answered as one JSON document or as a stream."""
        from polestar_jax.serving.scheduler import Job, NotAccepting, QueueFull

        settings = check_fields(req, self.served, self.limits, self.scheduler.dcfg, self.default_temperature)
        rows = None
        if chat and getattr(self.model, "takes_images", False):  # LLaDA-V: image_url parts (serving.images)
            from polestar_jax.serving.images import chat_prompt

            try:  # (image decoding and the tower off the event loop: other requests and streams go on)
                ids, rows = await asyncio.to_thread(chat_prompt, self.model, req.messages, self.limits.image_dir,
                                                    self.limits.max_prompt_tokens)
            except PolestarError as e:
                raise BadRequest(f"messages: {e}", "messages") from None
        else:
            ids = prompt_ids(self.model, req)  # (its length and ids: the scheduler's check, at submit)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(ev):  # on the scheduler's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the request's loop is gone
                pass

        job = Job(prompt=ids, on_event=on_event, images=rows, **settings)
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            self.metrics.record("outcome", "rejected")
            retry = max(1, math.ceil(self.scheduler.queue_length / max(1, self.scheduler.max_batch)))
            return self.error(429, str(e), kind="rate_limit_error", headers={"Retry-After": str(retry)})
        except NotAccepting as e:
            self.metrics.record("outcome", "rejected")
            return self.error(503, str(e), kind="server_error")
        except PolestarError as e:  # the scheduler's check of the prompt (Scheduler.check)
            raise BadRequest(str(e), "messages" if chat else "prompt") from None
        reply = Reply(self.served, chat, ids)
        if req.stream:
            from fastapi.responses import StreamingResponse

            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(reply.stream(job, events, include_usage), media_type="text/event-stream")
        return await self.wait(request, job, events, reply)

    async def wait(self, request, job, events: asyncio.Queue, reply: "Reply"):
        """A non-streaming request's answer (a client that disconnects cancels its job)."""
        from fastapi.responses import JSONResponse, PlainTextResponse

        while True:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return PlainTextResponse("", status_code=499)
                continue
            if ev.kind == "error":
                return self.error(500, ev.message, kind="server_error")
            if ev.kind == "done":
                return JSONResponse(reply.document(ev))


class Reply:
    """The response objects of one request (OpenAI's completion / chat completion and their chunks)."""

    def __init__(self, served: str, chat: bool, ids: list[int]):
        self.served, self.chat, self.ids = served, chat, ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def usage(self, c) -> dict:
        return {"prompt_tokens": len(self.ids), "completion_tokens": len(c.response_ids),
                "total_tokens": len(self.ids) + len(c.response_ids)}

    @staticmethod
    def extra(ev) -> dict:
        return {"nfe": ev.completion.nfe, "tpf": ev.completion.tpf, "blocks": len(ev.row.block_nfe),
                **ev.completion.stats}

    def document(self, ev) -> dict:
        choice = {"index": 0, "finish_reason": ev.completion.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": ev.text}
        else:
            choice["text"] = ev.text
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.served, "choices": [choice], "usage": self.usage(ev.completion),
                "polestar": self.extra(ev)}

    def chunk(self, text: Optional[str], finish: Optional[str], first: bool = False, **more) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.served, "choices": [choice], **more}
        return "data: " + json.dumps(body) + "\n\n"

    async def stream(self, job, events: asyncio.Queue, include_usage: bool):
        """Server-sent events: one per finished block, the finish reason, (usage), then ``[DONE]``."""
        first = True
        try:
            while True:
                ev = await events.get()
                if ev.kind == "block":
                    yield self.chunk(ev.text, None, first)
                    first = False
                elif ev.kind == "error":
                    yield "data: " + json.dumps(error_body(ev.message, kind="server_error")) + "\n\n"
                    break
                else:
                    if first:
                        yield self.chunk("", None, True)
                    yield self.chunk(None, ev.completion.finish_reason, polestar=self.extra(ev))
                    if include_usage:
                        yield "data: " + json.dumps({"id": self.id, "object": "chat.completion.chunk" if self.chat
                                                     else "text_completion", "created": self.created,
                                                     "model": self.served, "choices": [],
                                                     "usage": self.usage(ev.completion)}) + "\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): a running row leaves at the next block boundary
            job.cancel()


class Gate:
    """What a request meets before its endpoint: with an API key, the ``/v1/`` endpoints need ``Authorization:
    Bearer <key>`` (else 401, OpenAI's ``invalid_api_key``); while the server drains, every POST is a 503. A
    plain ASGI middleware: Starlette's ``@app.middleware`` (BaseHTTPMiddleware) would run each request in an
    extra task and pass every streamed chunk through a memory stream, CPU that the block computations need."""

    def __init__(self, app, api: Api, api_key: Optional[str] = None):
        self.app, self.api = app, api
        self.expected = None if api_key is None else ("Bearer " + api_key).encode()

    def authorized(self, scope) -> bool:
        if self.expected is None or not scope["path"].startswith("/v1/"):
            return True
        got = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        return hmac.compare_digest(got, self.expected)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not self.authorized(scope):
            self.api.metrics.record("outcome", "unauthorized")
            await self.api.error(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                 code="invalid_api_key")(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "POST" and self.api.draining:
            self.api.metrics.record("outcome", "rejected")
            await self.api.error(503, "the server is shutting down", kind="server_error")(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(model, scheduler, limits: "ServerLimits", served_name: str, default_temperature: float = 0.0,
               api_key: Optional[str] = None):
    """The FastAPI application over a started :class:`polestar_jax.serving.scheduler.Scheduler` (see the module
    docstring). ``model``: the :class:`polestar_jax.api.Model` (tokenizer, chat template); ``api_key``: the
    bearer token the ``/v1/`` endpoints require (None: open)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    api = Api(model, scheduler, limits, served_name, default_temperature)
    app = FastAPI(title="polestar-jax", docs_url=None, redoc_url=None)
    app.state.api = api

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        api.metrics.record("outcome", "bad_request")
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            loc, msg = [], "the body is not valid JSON"
        elif len(loc) > 1 and loc[-1] in ("str", "list[str]", "list[int]", "int", "float", "bool"):
            loc = loc[:1]  # a union member: name the field
        return api.error(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", ".".join(loc) or None)

    @app.exception_handler(BadRequest)
    async def _bad(request, exc: BadRequest):
        api.metrics.record("outcome", "bad_request")
        return api.error(exc.status, str(exc), exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return api.error(exc.status_code, str(exc.detail))

    app.add_middleware(Gate, api=api, api_key=api_key)

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        return await api.run(request, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatRequest):
        return await api.run(request, req, chat=True)

    card = {"id": served_name, "object": "model", "created": 0, "owned_by": "polestar-jax"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model_card(name: str):
        if name != served_name:
            return api.error(404, unknown_model(name, served_name), "model")
        return card

    @app.get("/health")
    async def health():
        status = "draining" if api.draining else ("ready" if scheduler.running else "not ready")
        body = {"status": status, "queue": scheduler.queue_length, "active_rows": scheduler.active_rows}
        return JSONResponse(body, status_code=200 if status == "ready" else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(api.metrics.render(scheduler), media_type=api.metrics.content_type)

    return app
