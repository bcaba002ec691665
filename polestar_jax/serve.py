"""``python -m polestar_jax.serve``: an OpenAI-compatible HTTP server with continuous batching at block
granularity (``polestar-serve``; see ``docs/serving.md``).

It loads a model folder (default: the bundled ``tiny_tasks`` model), compiles its block program for the
declared shapes at start (``--max-batch`` rows, prompts up to ``--max-prompt-tokens``, answers up to
``--max-tokens``), prints one line with its address when ready, and serves

* ``POST /v1/completions`` (the prompt as given) and ``POST /v1/chat/completions`` (the folder's chat
  template), streaming (one server-sent event per finished block, then ``data: [DONE]``) or not;
* ``GET /v1/models``, ``GET /health`` (200 ready, 503 starting or draining), ``GET /metrics`` (Prometheus).

Requests join the running batch at the next block boundary and leave when their answer is done
(:mod:`polestar_jax.serving.scheduler`); a request's tokens depend only on its prompt, settings and seed (default
0), so they equal ``python -m polestar_jax.generate --seed S --temperature T --gen-length G`` on that prompt
alone (G: ``max_tokens`` rounded up to whole blocks; completions: with ``--no-chat``). Bad input is a 400
with an OpenAI-style error object; a full queue a 429 with ``Retry-After``; SIGTERM / Ctrl-C stops
accepting (503), finishes the requests in flight within ``--drain-seconds`` and exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Optional, Sequence

from polestar_jax import cli
from polestar_jax.config import BATCH_WAIT, DecodeConfig, PolestarConfig
from polestar_jax.errors import PolestarError

#: The default prompt slot of a model that takes images (LLaDA-V: one image at anyres_max_4 is up to ~3.7k rows)
IMAGE_PROMPT_TOKENS = 4096


# ------------------------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    ap = cli.Parser(prog="python -m polestar_jax.serve",
                    description="Serve a LLaDA or Dream model over an OpenAI-compatible HTTP API, with continuous "
                                "batching at block granularity.")
    ap.add_argument("--model", help="model folder (HF or converted; default: the bundled tiny_tasks model)")
    ap.add_argument("--served-model-name", default=None,
                    help="the model name clients use (default: the folder's name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free port, printed)")
    ap.add_argument("--api-key", default=os.environ.get("POLESTAR_API_KEY") or None,
                    help="require 'Authorization: Bearer KEY' on the /v1/ endpoints; else 401 (default: "
                         "$POLESTAR_API_KEY, else none; /health and /metrics stay open)")
    s = ap.add_argument_group("capacity (the shapes compiled at start)")
    s.add_argument("--max-batch", type=int, default=8, help="rows decoding at once (default: 8)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a row at most; beyond: 429 (default: 64)")
    s.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens (the prompt slot; default: 128, or what the model's length allows)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="largest max_tokens a request may ask (default: the folder's gen length, else 128)")
    s.add_argument("--compact-rows", type=int, default=None,
                   help="a block call's start and steps run on the rows that need them, in chunks of this many "
                        "(default: an eighth of a batch of 16 or more, at least 8; 0: every row in every call)")
    s.add_argument("--batch-wait", type=float, default=BATCH_WAIT,
                   help="after rows finish, wait up to this fraction of the last block call for new requests to "
                        f"fill their slots before the next block (default: {BATCH_WAIT}; 0: never)")
    s.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C, seconds to finish the requests in flight (default: 30)")
    d = ap.add_argument_group("decoding defaults (DecodeConfig; per request: temperature, seed, threshold)")
    cli.add_config_flags(d, DecodeConfig, skip=("gen_length", "steps"))
    g = ap.add_argument_group("Polestar knobs (PolestarConfig, decoders polestar and polestar_v)")
    cli.add_config_flags(g, PolestarConfig)
    ap.add_argument("--allow-local-images", default=None, metavar="DIR",
                    help="LLaDA-V: image_url parts may also be file:// URLs of files under DIR (default: base64 "
                         "data: URLs only)")
    ap.add_argument("--mesh", default=None, help="shard over a device mesh, e.g. data=2,model=4")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="cast weights (default: as stored)")
    ap.add_argument("--weights", default="float", choices=["float", "int8"],
                    help="float (default) or int8 matmul weights with a scale per output channel")
    ap.add_argument("--quiet", action="store_true", help="no compile progress on stderr")
    return ap


# ------------------------------------------------------------------------------------------ running it
def _limits(args, model):
    """(:class:`polestar_jax.serving.app.ServerLimits`, the server's DecodeConfig) of the flags and the model."""
    from polestar_jax.resolve import resolve
    from polestar_jax.serving.app import ServerLimits, round_up

    given = cli.given_config_values(args, DecodeConfig)
    knobs = cli.given_config_values(args, PolestarConfig)
    block = given.get("block_length") or model.defaults.get("block_length", 32)
    max_tokens = args.max_tokens if args.max_tokens is not None else model.defaults.get("gen_length", 128)
    if max_tokens < 1:
        raise PolestarError(f"--max-tokens must be >= 1, got {max_tokens}")
    given["gen_length"] = round_up(max_tokens, block)
    given.setdefault("block_length", block)
    flag = cli.flag_namer({**given, **knobs}, PolestarConfig, DecodeConfig)
    dcfg = resolve(given, knobs, model.defaults, family=model.config.family, name=flag).decode
    room = model.config.max_sequence_length - dcfg.gen_length
    if room < 1:
        asked = (f"--max-tokens {max_tokens}" if args.max_tokens is not None else
                 f"max_tokens {max_tokens} (the folder's gen length; set --max-tokens)")
        raise PolestarError(f"{asked} decodes {dcfg.gen_length} tokens (whole blocks of {dcfg.block_length}), which "
                            f"leaves no room for a prompt in the model's max_sequence_length "
                            f"{model.config.max_sequence_length}")
    default_slot = IMAGE_PROMPT_TOKENS if model.takes_images else 128  # (LLaDA-V: an image is >= 729 rows)
    slot = args.max_prompt_tokens if args.max_prompt_tokens is not None else min(default_slot, room)
    if slot < 1:
        raise PolestarError(f"--max-prompt-tokens must be >= 1, got {slot}")
    if slot > room:
        raise PolestarError(f"--max-prompt-tokens {slot} + gen length {dcfg.gen_length} exceeds the model's "
                            f"max_sequence_length {model.config.max_sequence_length}")
    from polestar_jax.serving.scheduler import check_settings

    check_settings(args.max_batch, args.max_queue, args.batch_wait, name=flag)
    if args.drain_seconds < 0:
        raise PolestarError(f"--drain-seconds must be >= 0, got {args.drain_seconds}")
    if args.compact_rows is not None and args.compact_rows < 0:
        raise PolestarError(f"--compact-rows must be >= 0, got {args.compact_rows}")
    image_dir = args.allow_local_images
    if image_dir is not None and not model.takes_images:
        raise PolestarError("--allow-local-images needs a model that takes images (LLaDA-V)")
    if image_dir is not None and not os.path.isdir(image_dir):
        raise PolestarError(f"--allow-local-images: no such folder: {image_dir}")
    return ServerLimits(slot, max_tokens, dcfg.block_length, image_dir), dcfg


def test_bed_note(path: str) -> Optional[str]:
    """The note the server prints at start when ``path`` is one of the bundled test beds
    (``polestar_jax/assets/*``): they know chat-formatted prompts only, so a plain ``/v1/completions`` prompt
    gets an empty answer (HTTP 200); None for any other folder."""
    from polestar_jax.io.tokenizer import bundled_model_dir

    assets = os.path.dirname(os.path.realpath(bundled_model_dir()))
    folder = os.path.realpath(path)
    if os.path.dirname(folder) != assets:
        return None
    return (f"note: '{os.path.basename(folder)}' is a bundled test bed that knows chat-formatted prompts only: "
            "/v1/chat/completions applies the chat template; a /v1/completions prompt must be the template's "
            "rendering (docs/serving.md#completions-on-a-chat-model), or the answer is empty")


def event_loop():
    """The module whose ``run`` drives the server: uvloop where it is installed (the ``serve`` extra; more
    tokens/s on the 2-core CPU in alternating runs: docs/serving.md), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio
    return uvloop if hasattr(uvloop, "run") else asyncio  # (uvloop.run: 0.18 and later)


def run(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import fastapi  # noqa: F401  (the serve extra)
        import prometheus_client  # noqa: F401
        import pydantic  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise PolestarError(f"the server needs its extra packages: pip install 'polestar-jax[serve]' ({e})") from None
    if args.model is not None:
        cli.need_folder(args.model)
    if args.api_key is not None and (not args.api_key.strip() or any(c.isspace() for c in args.api_key)):
        raise PolestarError("--api-key must be a non-empty word (no spaces)")
    if not 0 <= args.port < 65536:
        raise PolestarError(f"--port must be in [0, 65535], got {args.port}")
    from polestar_jax import api
    from polestar_jax.serving.scheduler import Scheduler
    from polestar_jax.serving.app import create_app

    log = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    model = api.load(args.model, dtype=args.dtype, mesh=args.mesh, compile_cache=True, log=log, weights=args.weights)
    limits, dcfg = _limits(args, model)
    note = test_bed_note(model.path)
    if note:
        print(note, file=sys.stderr, flush=True)
    served = args.served_model_name or os.path.basename(os.path.normpath(model.path))
    t0 = time.perf_counter()
    scheduler = Scheduler(model.engine, dcfg, args.max_batch, limits.max_prompt_tokens, args.max_queue,
                          sampling=True, compact_rows=args.compact_rows, batch_wait=args.batch_wait)
    compile_s = time.perf_counter() - t0
    app = create_app(model, scheduler, limits, served, default_temperature=dcfg.temperature, api_key=args.api_key)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM / Ctrl-C: 503 for new requests, drain, exit 0
            app.state.api.draining = True
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a clean exit (status 0), not the signal re-raised

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=args.drain_seconds)
    server = Server(config)

    async def main() -> None:
        scheduler.start()
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            w = scheduler.batch.spec.compact_rows
            chunks = f" in chunks of {w}" if w else ""
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            print(f"polestar-jax serving '{served}' at http://{host}:{port} (decoder {dcfg.decoder}, batch "
                  f"{args.max_batch}{chunks}, prompts <= {limits.max_prompt_tokens} tokens, max_tokens <= "
                  f"{limits.max_tokens}; compiled in {compile_s:.1f}s)", flush=True)
        await task

    try:
        event_loop().run(main())
    finally:
        done = scheduler.drain(max(0.0, args.drain_seconds)) if scheduler.running else True
        scheduler.stop()
        if log is not None:
            log("stopped" + ("" if done else " (requests still running were ended)"))
    if not server.started:
        raise PolestarError(f"could not listen on {args.host}:{args.port}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli.report_errors(run, argv)


if __name__ == "__main__":
    sys.exit(main())
