"""``python -m polestar_jax.generate``: generate a response with a LLaDA or Dream model folder.

Loads an HF folder or a converted (orbax) folder, renders the prompt with the folder's chat template, runs
the chosen decoder and prints the response and one stats line (NFE, tokens per forward, tokens/s, compile
time apart). With ``--json`` stdout is one line, a JSON document (the text goes to stderr). Without ``--model`` it runs the
bundled ``tiny_tasks`` model (a tiny LLaDA trained on the list tasks of ``bench/tasks``), offline.

The decoder flags and their defaults are generated from :class:`polestar_jax.config.DecodeConfig` and
:class:`polestar_jax.config.PolestarConfig`, so ``--help`` and the configs cannot disagree. A flag that
would have no effect in the chosen mode (a Polestar knob with another decoder, ``--steps`` with a
threshold rule, a planning flag without ``--dry-run``) is an error, as is any value the configs reject:
one ``error:`` line on stderr, exit status 2. Ctrl-C ends the run with ``interrupted`` and status 130.
"""
from __future__ import annotations

if __name__ == "__main__":  # first of all: Ctrl-C from here on ends cleanly (polestar_jax.cli takes over)
    import os as _os
    import signal as _signal

    _signal.signal(_signal.SIGINT, lambda *_: (_os.write(2, b"interrupted\n"), _os._exit(130)))

import argparse
import dataclasses
import sys
from typing import Optional, Sequence

from polestar_jax import cli
from polestar_jax.config import DecodeConfig, ModelConfig, PolestarConfig
from polestar_jax.errors import PolestarError

#: Flags that only ``--dry-run`` reads, with their defaults.
_PLAN_FLAGS = {"model_config": None, "batch": 1, "prompt_length": 128, "image_size": None}


def build_parser() -> argparse.ArgumentParser:
    ap = cli.Parser(prog="python -m polestar_jax.generate",
                    description="Generate text with a LLaDA or Dream diffusion LM (Polestar, Fast-dLLM or LLaDA "
                                "decoders).")
    ap.add_argument("--model", help="model folder (HF or converted; default: the bundled tiny_tasks model, "
                                    "polestar_jax/assets/tiny_tasks)")
    ap.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    ap.add_argument("--prompts-file", help="a UTF-8 file with one prompt per line (blank lines skipped)")
    ap.add_argument("--image", action="append", default=None, metavar="PATH",
                    help="LLaDA-V: an image the prompt asks about (once: every prompt asks about it; repeated: one "
                         "per prompt, in order; 'none' for a text-only prompt)")
    ap.add_argument("--seed", type=int, default=0,
                    help="job seed: prompt i's sampling noise and k-means draws come from (seed, i) (default: 0)")
    d = ap.add_argument_group("decoding (DecodeConfig; gen/block length default to the model folder's "
                              "generation_config.json, else 128/32; cache: none for llada, else dual)")
    cli.add_config_flags(d, DecodeConfig)
    g = ap.add_argument_group("Polestar knobs (PolestarConfig, decoders polestar and polestar_v; defaults = the reference code; "
                              "a Dream model starts from Dream's official values of --full-prefix-rows, "
                              "--full-suffix-rows, --proxy-score, --patch-kv, --tie-break)")
    cli.add_config_flags(g, PolestarConfig)
    ap.add_argument("--mesh", default=None, help="shard over a device mesh, e.g. data=2,model=4 (with several "
                                                 "processes: over all their devices)")
    cli.add_distributed_flags(ap)
    p = ap.add_argument_group("memory planning (no weights)")
    p.add_argument("--dry-run", action="store_true",
                   help="print parameter, cache and compiled-step memory instead of generating")
    p.add_argument("--model-config", help="config.json to plan for (default: the --model folder's)")
    p.add_argument("--batch", type=int, default=None, help="batch size to plan for (default: 1)")
    p.add_argument("--prompt-length", type=int, default=None,
                   help="prompt length to plan for (default: 128; LLaDA-V: 128 + the largest image's tokens)")
    p.add_argument("--image-size", action="append", default=None, metavar="WxH",
                   help="LLaDA-V: an image size to report the tokens of (repeat; default: a range of sizes)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="cast weights (default: as stored; --dry-run plans for the torch_dtype config.json "
                         "declares, else bfloat16)")
    ap.add_argument("--weights", default="float", choices=["float", "int8"],
                    help="float (default) or int8: every matmul weight stored as int8 with a scale per output "
                         "channel, about half the memory of bfloat16 (docs/scaling.md#int8-weights)")
    ap.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout (one line; the "
                                                        "responses and the stats line go to stderr)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="rows decoding at once (default: every prompt); a finished row's slot takes the next "
                         "prompt at the next block boundary")
    ap.add_argument("--quiet", action="store_true", help="no compile progress or notes on stderr")
    ap.add_argument("--precompile", metavar="BxS[,BxS...]", default=None,
                    help="compile the block programs of these shapes first (batch x prompt slot, e.g. 1x48,8x64; "
                         "prompt slots are multiples of 16); without a prompt: compile them into the "
                         "persistent cache and exit")
    return ap


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``--precompile``'s shapes: ``"1x48,8x64"`` -> [(1, 48), (8, 64)]; one-line errors otherwise."""
    shapes = []
    for part in text.split(","):
        b, sep, slot = part.strip().lower().partition("x")
        if not (sep and b.isdigit() and slot.isdigit() and int(b) > 0 and int(slot) > 0):
            raise PolestarError(f"--precompile takes shapes BATCHxSLOT separated by commas (e.g. 1x48,8x64), "
                                f"got {part.strip()!r}")
        if int(slot) % 16:
            raise PolestarError(f"--precompile: a prompt slot is a multiple of 16 (prompts are padded to one), "
                                f"got {slot}")
        shapes.append((int(b), int(slot)))
    return shapes


def resolve_args(args, defaults: Optional[dict] = None, family: Optional[str] = None):
    """The :class:`polestar_jax.resolve.Resolved` configuration of the parsed arguments (the one resolution
    the API, the lm-eval model and the server share): ``defaults`` (the model folder's
    :func:`polestar_jax.io.checkpoint.generation_defaults`) fill ``--gen-length`` / ``--block-length`` when
    they are not given; ``family`` (the model's ``ModelConfig.family``) gives decoder polestar its family's
    Polestar parameters under the knobs given. Raises :class:`PolestarError` for a flag that would have no
    effect; the notes say what the resolution changed."""
    from polestar_jax.resolve import resolve

    given = cli.given_config_values(args, DecodeConfig)
    knobs = cli.given_config_values(args, PolestarConfig)
    flag = cli.flag_namer({**given, **knobs}, PolestarConfig, DecodeConfig)
    return resolve(given, knobs, defaults, family=family, name=flag)


def decode_config_from_args(args, defaults: Optional[dict] = None, family: Optional[str] = None) -> DecodeConfig:
    """The :class:`DecodeConfig` of the parsed arguments (see :func:`resolve_args`)."""
    return resolve_args(args, defaults, family).decode


def read_images(args, cfg: ModelConfig, n_prompts: int) -> Optional[list]:
    """``--image``: one RGB image per prompt (or None for ``none``), each opened and checked before any
    weight is read; one-line errors for a model without a vision tower, a count that matches neither one nor
    the prompts, and a bad image."""
    if not args.image:
        return None
    if cfg.vision is None:
        raise PolestarError(f"--image needs a LLaDA-V model; this one is {cfg.family}")
    if len(args.image) not in (1, n_prompts):
        raise PolestarError(f"--image is given {len(args.image)} times for {n_prompts} prompts (give it once, or "
                            "once per prompt)")
    from polestar_jax.io.images import open_image

    opened = [None if p.lower() == "none" else open_image(p) for p in args.image]
    return opened * n_prompts if len(opened) == 1 else opened


def read_prompts(args) -> list[str]:
    """The prompts of ``--prompt`` and ``--prompts-file``; one-line errors for none, empty ones and bytes
    that are not UTF-8 (naming the file or prompt and the byte offset)."""
    prompts = [cli.check_utf8(p, f"--prompt {i}") for i, p in enumerate(args.prompt)]
    if args.prompts_file:
        prompts += [line for line in cli.read_utf8_lines(args.prompts_file) if line.strip()]
    if not prompts:
        raise PolestarError("no prompt given (use --prompt TEXT or --prompts-file FILE)")
    for i, p in enumerate(prompts):
        if not p.strip():
            raise PolestarError(f"prompt {i} is empty")
    return prompts


from polestar_jax.engine.compile_cache import compile_summary, enable_compile_cache  # noqa: E402,F401 - kept here for callers and tests


def _precompile(engine, dcfg: DecodeConfig, shapes, compile_only: bool, leader: bool) -> bool:
    """``--precompile``: compiles the shapes' programs; without a prompt prints one line (True: done)."""
    ahead = engine.precompile(dcfg, shapes)
    if compile_only and leader:
        print(f"precompiled {len(ahead)} program{'' if len(ahead) == 1 else 's'} in "
              f"{sum(r.seconds for r in ahead):.2f}s{compile_summary(ahead)}")
    return compile_only


#: Weight dtypes a config.json's ``torch_dtype`` may name that ``--dry-run`` plans for as they are.
PLAN_DTYPES = ("float32", "bfloat16", "float16")


def stored_dtype(path: str) -> tuple[str, str]:
    """The weight dtype ``--dry-run`` plans for without ``--dtype`` (what loading without ``--dtype`` keeps):
    the ``torch_dtype`` that the ``config.json`` of ``path`` (a folder or the file) declares, else bfloat16
    (the released LLaDA and Dream checkpoints' dtype); and where it came from, for the plan line."""
    import json
    import os

    f = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(f) as fh:
            declared = json.load(fh).get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        declared = None
    if declared in PLAN_DTYPES:
        return declared, "config.json torch_dtype"
    return "bfloat16", "assumed: config.json declares no torch_dtype"


def dry_run(args, dcfg: DecodeConfig, cfg: ModelConfig, path: str) -> int:
    """``--dry-run``: memory plan of the model config ``cfg`` (read from ``path``) from abstract arrays only
    (see :mod:`polestar_jax.engine.plan`)."""
    from polestar_jax.engine.plan import plan

    for flag, value in (("--prompt", args.prompt), ("--prompts-file", args.prompts_file), ("--mesh", args.mesh),
                        ("--coordinator", args.coordinator), ("--num-processes", args.num_processes),
                        ("--process-id", args.process_id)):
        if value:
            raise PolestarError(f"{flag} is not used by --dry-run (it plans for --batch x --prompt-length)")
    batch = args.batch if args.batch is not None else _PLAN_FLAGS["batch"]
    prompt_length = args.prompt_length if args.prompt_length is not None else _PLAN_FLAGS["prompt_length"]
    images = _plan_images(args, cfg, path)
    if images and args.prompt_length is None:  # LLaDA-V: room for the largest image's rows
        prompt_length += max(p.tokens for p in images)
    if batch < 1 or prompt_length < 1:
        raise PolestarError("--batch and --prompt-length must be >= 1")
    if prompt_length + dcfg.gen_length > cfg.max_sequence_length:
        raise PolestarError(f"prompt length {prompt_length} + gen length {dcfg.gen_length} exceeds "
                            f"max_sequence_length {cfg.max_sequence_length}")
    dtype, source = (args.dtype, "--dtype") if args.dtype else stored_dtype(path)
    mp = plan(cfg, dcfg, batch=batch, prompt_len=prompt_length, dtype=dtype, weights=args.weights)
    print(f"plan: {path} decoder={dcfg.decoder} batch={batch} prompt={prompt_length} "
          f"gen={dcfg.gen_length} block={dcfg.block_length} dtype={dtype} ({source}) weights={args.weights} "
          f"kv_cache={dcfg.kv_cache}")
    for line in mp.lines() + [p.line() for p in images]:
        print("  " + line)
    if args.json:
        cli.print_json({**dataclasses.asdict(mp), "images": [dataclasses.asdict(p) for p in images]})
    return 0


#: Image sizes ``--dry-run`` reports for a LLaDA-V model without ``--image-size``.
PLAN_IMAGE_SIZES = ((384, 384), (640, 480), (1024, 768), (1280, 720), (1920, 1080), (2304, 2304))


def parse_image_size(text: str) -> tuple[int, int]:
    """``--image-size``'s ``"WxH"`` -> (w, h); one-line errors otherwise."""
    w, sep, h = text.strip().lower().partition("x")
    if not (sep and w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0):
        raise PolestarError(f"--image-size takes WIDTHxHEIGHT in pixels (e.g. 1024x768), got {text!r}")
    return int(w), int(h)


def _plan_images(args, cfg: ModelConfig, path: str) -> list:
    """``--dry-run`` of a LLaDA-V config: the tokens (and the tower's memory) of each image size."""
    if cfg.vision is None:
        if args.image_size:
            raise PolestarError(f"--image-size needs a LLaDA-V config; {path} is {cfg.family}")
        return []
    from polestar_jax.engine.plan import plan_images

    sizes = [parse_image_size(t) for t in args.image_size] if args.image_size else list(PLAN_IMAGE_SIZES)
    dtype = args.dtype or stored_dtype(path)[0]
    return plan_images(cfg, sizes, dtype)


def _check_plan_flags(args) -> None:
    if not args.dry_run:
        for name in _PLAN_FLAGS:
            if getattr(args, name) is not None:
                raise PolestarError(f"--{name.replace('_', '-')} applies to --dry-run only")


def run(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _check_plan_flags(args)
    if args.model is not None:
        cli.need_folder(args.model)
    from polestar_jax.io.checkpoint import generation_defaults
    from polestar_jax.io.tokenizer import bundled_model_dir

    model_dir = args.model or bundled_model_dir()
    plan_file = args.model_config if args.dry_run else None
    # config.json read once: its family resolves the flags (before any weight is read), then the loader takes it
    cfg = ModelConfig.from_json(plan_file or model_dir)
    resolved = resolve_args(args, {} if plan_file else generation_defaults(model_dir), cfg.family)
    dcfg = resolved.decode
    if not args.quiet:
        for note in resolved.notes:
            print(f"note: {note}", file=sys.stderr)
    if args.batch_size is not None and args.batch_size < 1:
        raise PolestarError(f"--batch-size must be >= 1, got {args.batch_size}")
    shapes = None if args.precompile is None else parse_shapes(args.precompile)
    compile_only = shapes is not None and not args.prompt and not args.prompts_file
    prompts = None if args.dry_run or compile_only else read_prompts(args)
    if args.image and (args.dry_run or compile_only):
        raise PolestarError("--image needs a prompt to ask about it (not --dry-run or --precompile alone)")
    images = None if prompts is None else read_images(args, cfg, len(prompts))
    enable_compile_cache()
    if args.dry_run:
        return dry_run(args, dcfg, cfg, plan_file or model_dir)
    model = _load(args, model_dir, cfg)
    from polestar_jax import sharding

    if shapes is not None and _precompile(model.engine, dcfg, shapes, compile_only, sharding.is_leader()):
        return 0
    engine = model.engine
    n0 = engine.compiles
    ids, rows = model.image_prompts(prompts, images, chat=not args.no_chat)
    out = model.generate_ids(ids, dcfg, seed=args.seed, batch_size=args.batch_size, prompts=prompts, images=rows)
    compiled = list(engine.compile_records)[len(engine.compile_records) - (engine.compiles - n0):]
    if not sharding.is_leader():  # process 0 prints the results (every process has them)
        return 0
    _print_rows(out, dcfg, compiled, sys.stderr if args.json else sys.stdout)
    if args.json:
        cli.print_json(_json_document([g.to_dict() for g in out], out, model_dir, compiled))
    return 0


def _load(args, model_dir: str, cfg: ModelConfig):
    """The :class:`polestar_jax.api.Model` of the command line, loaded as :func:`polestar_jax.api.load` loads
    (with ``cfg``, the config already read): the multi-process runtime joined first, then the mesh."""
    from polestar_jax import api, sharding

    multi = cli.join_from_args(args)  # before anything uses a device
    mesh = sharding.mesh_or_none(args.mesh)
    if multi and mesh is None and sharding.is_leader():
        print("warning: several processes but no --mesh: every process decodes the whole batch on its own "
              "first device", file=sys.stderr)
    log = None if args.quiet or not sharding.is_leader() else (lambda m: print(m, file=sys.stderr, flush=True))
    # (with a mesh each process reads its own shards)
    return api.Model(model_dir, dtype=args.dtype, mesh=mesh, log=log, config=cfg, weights=args.weights)


def _print_rows(out, dcfg: DecodeConfig, compiled, text_out) -> None:
    """The responses, one stats line per row and the job's stats line (with ``--json``: on stderr, so that
    stdout carries exactly one line, the JSON document)."""
    for g in out:
        if len(out) > 1:
            print(f"--- [{g.row}] {g.prompt}", file=text_out)
        print(g.text, file=text_out)
        st = g.stats
        extra = (f" refresh_steps={st['refresh_steps']} early_commits={st['early_commits']} "
                 f"suffix_commits={st['suffix_commits']}") if "refresh_steps" in st else ""
        print(f"[{dcfg.decoder}/{dcfg.cache}] nfe={g.nfe} tpf={g.tpf:.2f} tokens={g.non_eos_tokens}{extra}",
              file=text_out)
    print(f"stats: nfe={out.nfe} tpf={out.tpf:.2f} tokens/s={out.tps:.1f} decode={out.seconds:.3f}s "
          f"compile={out.compile_seconds:.2f}s{compile_summary(compiled)}", file=text_out)


def compile_record_json(rec) -> dict:
    """One entry of the ``--json`` document's ``compiled`` list: a
    :class:`~polestar_jax.engine.compile_cache.CompileRecord`'s fields (``from_store``: loaded from the
    executable store, nothing traced)."""
    return dataclasses.asdict(rec)


def _json_document(rows: list[dict], out, model_dir: str, compiled=()) -> dict:
    """The ``--json`` document: one row's fields (several rows: lists of the text, token ids, forwards, TPF
    and Polestar's counters), the job's totals, and every row as :meth:`polestar_jax.api.Generation.to_dict`
    gives it (``non_eos_tokens``, ``stats``, ...)."""
    one = len(rows) == 1
    out_doc = dict(rows[0]) if one else {"text": [r["text"] for r in rows]}
    for key in rows[0]["stats"]:  # decoder polestar: refresh_steps, early_commits, ... also at the top
        out_doc[key] = rows[0]["stats"][key] if one else [r["stats"][key] for r in rows]
    for key in ("nfe", "tpf", "token_ids"):
        out_doc[key] = rows[0][key] if one else [r[key] for r in rows]
    dcfg = out.decode
    out_doc.update({"tps": out.tps, "decode_seconds": out.seconds, "compile_seconds": out.compile_seconds,
                    "compiled": [compile_record_json(r) for r in compiled],
                    "decoder": dcfg.decoder, "cache": dcfg.cache, "gen_length": dcfg.gen_length,
                    "block_length": dcfg.block_length, "early_exit": dcfg.early_exit, "model": model_dir,
                    "rows": rows})
    return out_doc


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli.run_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
