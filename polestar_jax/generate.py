"""``python -m polestar_jax.generate``: generate a response with a LLaDA model folder.

Loads an HF folder or a converted (orbax) folder, renders the prompt with the folder's chat template, runs
the chosen decoder and prints the response and one stats line (NFE, tokens per forward, tokens/s, compile
time apart). With ``--json`` the last line of stdout is a JSON object. Without ``--model`` it runs the tiny
random model bundled with the package (gibberish text, but the whole path runs offline).

Bad input (missing folder, corrupt weights, invalid lengths, unknown options) prints one ``error:`` line on
stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional, Sequence


from polestar_jax.config import CACHES, DECODERS, OFFLOAD_HIDDEN, REMASKING, DecodeConfig, ModelConfig
from polestar_jax.errors import PolestarError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit status 2, never a usage dump or traceback
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _threshold(v: str) -> Optional[float]:
    if v.lower() == "none":
        return None
    try:
        return float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid threshold {v!r} (a number or 'none')") from None


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m polestar_jax.generate",
                 description="Generate text with a LLaDA diffusion LM (Polestar, Fast-dLLM or LLaDA decoders).")
    ap.add_argument("--model", help="model folder (HF or converted); default: the bundled tiny random model")
    ap.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    ap.add_argument("--prompts-file", help="a file with one prompt per line")
    ap.add_argument("--decoder", default="polestar", choices=DECODERS)
    ap.add_argument("--cache", default=None, choices=CACHES,
                    help="KV cache (default: dual; llada: none; polestar needs dual)")
    ap.add_argument("--gen-length", type=int, default=None,
                    help="tokens to generate (default: the model folder's generation_config.json, else 128)")
    ap.add_argument("--block-length", type=int, default=None,
                    help="block length (default: the model folder's generation_config.json, else 32)")
    ap.add_argument("--steps", type=int, default=None, help="total forwards of the fixed schedule (default: gen length)")
    ap.add_argument("--threshold", type=_threshold, default="0.9",
                    help="confidence threshold (fastdllm; 'none' = fixed schedule)")
    ap.add_argument("--factor", type=float, default=None, help="Fast-dLLM dynamic factor rule instead of a threshold")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--remasking", default="low_confidence", choices=REMASKING)
    ap.add_argument("--seed", type=int, default=0, help="PRNG seed (row r uses seed + r)")
    g = ap.add_argument_group("Polestar knobs (defaults = the reference code)")
    g.add_argument("--clusters", type=int, default=8, help="k-means clusters per layer (prefix + suffix)")
    g.add_argument("--top-k", type=int, default=4, help="clusters refreshed per layer (1 at the last layer)")
    g.add_argument("--early-threshold", type=_threshold, default="0.7",
                   help="lower confidence bound of early commit ('none' disables early commit)")
    g.add_argument("--windowed-period", type=int, default=4,
                   help="every n-th block starts with a windowed pass (0: always a full pass)")
    g.add_argument("--no-suffix-commit", action="store_true", help="disable suffix pre-commit")
    g.add_argument("--offload-hidden", default="none", choices=list(OFFLOAD_HIDDEN),
                   help="store the refresh rows' hidden states int8 (per-row scales) or bf16 in host memory "
                        "(pinned_host) instead of exact in device memory")
    g.add_argument("--refresh-buckets", type=int, default=4,
                   help="compiled widths per refresh stage (0 and ceil(i*R/n)): more = fewer rows computed "
                        "and moved, longer compile; 1 = every window row (the result is the same)")
    g.add_argument("--kernels", default="auto", choices=["auto", "pallas", "interpret", "reference"],
                   help="drift/refresh kernels: auto = Pallas on GPU/TPU, jnp reference on CPU")
    ap.add_argument("--mesh", default=None, help="shard over a device mesh, e.g. data=2,model=4")
    p = ap.add_argument_group("memory planning (no weights)")
    p.add_argument("--dry-run", action="store_true",
                   help="print parameter, cache and compiled-step memory instead of generating")
    p.add_argument("--model-config", help="config.json to plan for (default: the --model folder's)")
    p.add_argument("--batch", type=int, default=1, help="batch size to plan for")
    p.add_argument("--prompt-length", type=int, default=128, help="prompt length to plan for")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="cast weights (default: as stored)")
    ap.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    ap.add_argument("--json", action="store_true", help="print a JSON object as the last line")
    return ap


def decode_config_from_args(args, defaults: Optional[dict] = None) -> DecodeConfig:
    """The :class:`DecodeConfig` of the parsed arguments; ``defaults`` (the model folder's
    :func:`polestar_jax.checkpoint.generation_defaults`) fill ``--gen-length`` / ``--block-length`` when
    they are not given."""
    from polestar_jax.config import PolestarConfig

    defaults = defaults or {}

    decoder = args.decoder
    threshold = args.threshold if isinstance(args.threshold, (float, type(None))) else _threshold(args.threshold)
    if decoder == "llada":
        cache = args.cache or "none"
        threshold = None
    else:
        cache = args.cache or "dual"
    if args.factor is not None:
        threshold = None
    early = args.early_threshold if not isinstance(args.early_threshold, str) else _threshold(args.early_threshold)
    pc = PolestarConfig(n_clusters=args.clusters, top_k=args.top_k, early_threshold=early,
                        windowed_period=args.windowed_period, suffix_precommit=not args.no_suffix_commit,
                        kernels=args.kernels, offload_hidden=args.offload_hidden,
                        refresh_buckets=args.refresh_buckets)
    gen_length = args.gen_length if args.gen_length is not None else defaults.get("gen_length", 128)
    block_length = args.block_length if args.block_length is not None else defaults.get("block_length", 32)
    block_length = min(block_length, gen_length) if args.block_length is None else block_length
    return DecodeConfig(decoder=decoder, cache=cache, gen_length=gen_length, block_length=block_length,
                        steps=args.steps, threshold=threshold, factor=args.factor, temperature=args.temperature,
                        remasking=args.remasking, polestar=pc)


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise PolestarError(f"cannot read prompts file {args.prompts_file}: {e.strerror}") from None
    if not prompts:
        raise PolestarError("no prompt given (use --prompt TEXT or --prompts-file FILE)")
    for i, p in enumerate(prompts):
        if not p.strip():
            raise PolestarError(f"prompt {i} is empty")
    return prompts


def response_ids(tokens: Sequence[int], cfg: ModelConfig, stop_ids: Sequence[int]) -> list[int]:
    """Generated ids up to (excluding) the first end-of-text token."""
    out = []
    for t in tokens:
        if t in stop_ids:
            break
        out.append(int(t))
    return out


def enable_compile_cache(path: Optional[str] = None) -> Optional[str]:
    """Turns on JAX's persistent compilation cache (``$POLESTAR_JAX_CACHE``, default
    ``~/.cache/polestar_jax/xla``; ``POLESTAR_JAX_CACHE=off`` disables it), so a second run of the same
    shapes skips compilation. Returns the folder used, or None."""
    import os

    import jax

    path = path or os.environ.get("POLESTAR_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "polestar_jax", "xla")
    if path.lower() == "off":
        return None
    try:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    except OSError:
        return None
    return path


def dry_run(args, dcfg: DecodeConfig) -> int:
    """``--dry-run``: memory plan from abstract arrays only (see :mod:`polestar_jax.plan`)."""
    from polestar_jax.plan import plan
    from polestar_jax.tokenizer import bundled_model_dir

    path = args.model_config or args.model or bundled_model_dir()
    cfg = ModelConfig.from_json(path)
    if args.batch < 1 or args.prompt_length < 1:
        raise PolestarError("--batch and --prompt-length must be >= 1")
    if args.prompt_length + dcfg.gen_length > cfg.max_sequence_length:
        raise PolestarError(f"prompt length {args.prompt_length} + gen length {dcfg.gen_length} exceeds "
                            f"max_sequence_length {cfg.max_sequence_length}")
    mp = plan(cfg, dcfg, batch=args.batch, prompt_len=args.prompt_length, dtype=args.dtype or "bfloat16")
    print(f"plan: {path} decoder={dcfg.decoder} batch={args.batch} prompt={args.prompt_length} "
          f"gen={dcfg.gen_length} block={dcfg.block_length} dtype={args.dtype or 'bfloat16'}")
    for line in mp.lines():
        print("  " + line)
    if args.json:
        print(json.dumps(dataclasses.asdict(mp)))
    return 0


def run(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    enable_compile_cache()
    from polestar_jax.checkpoint import generation_defaults
    from polestar_jax.tokenizer import bundled_model_dir

    defaults = {} if args.dry_run and args.model_config else generation_defaults(args.model or bundled_model_dir())
    dcfg = decode_config_from_args(args, defaults)
    if args.dry_run:
        return dry_run(args, dcfg)
    prompts = read_prompts(args)

    from polestar_jax.checkpoint import load_model
    from polestar_jax.engine import generate
    from polestar_jax.tokenizer import bundled_model_dir, load_tokenizer

    model_dir = args.model or bundled_model_dir()
    cfg, params = load_model(model_dir, dtype=args.dtype)
    tok = load_tokenizer(model_dir)
    ids = [tok.encode(p) if args.no_chat else tok.chat_prompt_ids(p) for p in prompts]
    from polestar_jax import sharding

    sharding.maybe_initialize_distributed()
    mesh = sharding.mesh_or_none(args.mesh)
    res = generate(params, cfg, ids, dcfg, seed=args.seed, mesh=mesh)

    stop = {cfg.eos_token_id, cfg.pad_token_id}
    eot = tok.token_to_id("<|eot_id|>")
    if eot is not None:
        stop.add(eot)
    rows = []
    for r in range(len(prompts)):
        gen = res.tokens[r].tolist()
        resp = response_ids(gen, cfg, sorted(stop))
        n_tokens = sum(1 for t in gen if t not in stop)  # TPF as the paper: non-EOS generated tokens / NFE
        nfe = int(res.nfe[r])
        row = {"prompt": prompts[r], "text": tok.decode(resp), "token_ids": gen, "nfe": nfe,
               "tpf": n_tokens / nfe if nfe else 0.0, "generated_tokens": n_tokens}
        if res.polestar is not None:
            row.update(refresh_steps=int(res.polestar["cluster_steps"][r].sum()),
                       early_commits=int(res.polestar["early"][r]),
                       suffix_commits=int(res.polestar["suffix"][r]),
                       windowed_passes=int(res.polestar["efficient"][r].sum()))
        rows.append(row)
    total_tokens = sum(r["generated_tokens"] for r in rows)
    tps = total_tokens / res.seconds if res.seconds > 0 else 0.0
    for i, row in enumerate(rows):
        if len(rows) > 1:
            print(f"--- [{i}] {row['prompt']}")
        print(row["text"])
        extra = ""
        if "refresh_steps" in row:
            extra = (f" refresh_steps={row['refresh_steps']} early_commits={row['early_commits']} "
                     f"suffix_commits={row['suffix_commits']}")
        print(f"[{dcfg.decoder}/{dcfg.cache}] nfe={row['nfe']} tpf={row['tpf']:.2f} "
              f"tokens={row['generated_tokens']}{extra}")
    print(f"stats: nfe={int(res.nfe.sum())} tpf={total_tokens / max(int(res.nfe.sum()), 1):.2f} "
          f"tokens/s={tps:.1f} decode={res.seconds:.3f}s compile={res.compile_seconds:.2f}s")
    if args.json:
        out = dict(rows[0]) if len(rows) == 1 else {"text": [r["text"] for r in rows]}
        for key in ("refresh_steps", "early_commits", "suffix_commits"):
            if key in rows[0]:
                out[key] = rows[0][key] if len(rows) == 1 else [r[key] for r in rows]
        out.update({"nfe": rows[0]["nfe"] if len(rows) == 1 else [r["nfe"] for r in rows],
                    "tpf": rows[0]["tpf"] if len(rows) == 1 else [r["tpf"] for r in rows],
                    "token_ids": rows[0]["token_ids"] if len(rows) == 1 else [r["token_ids"] for r in rows],
                    "tps": tps, "decode_seconds": res.seconds, "compile_seconds": res.compile_seconds,
                    "decoder": dcfg.decoder, "cache": dcfg.cache, "model": model_dir, "rows": rows})
        print(json.dumps(out))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    try:
        return run(argv)
    except PolestarError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
