"""Command line of the converter.

    python -m polestar_jax.convert HF_DIR OUT_DIR [--dtype bfloat16|float32]
    python -m polestar_jax.convert --to-hf CONVERTED_DIR OUT_HF_DIR [--max-shard-mb N] [--dtype ...]

Prints a one-line summary on success (exit 0); any user error is one ``error: ...`` line on stderr (exit 2).
"""
from __future__ import annotations

if __name__ == "__main__":  # first of all: Ctrl-C from here on ends cleanly (polestar_jax.cli takes over)
    import os as _os
    import signal as _signal

    _signal.signal(_signal.SIGINT, lambda *_: (_os.write(2, b"interrupted\n"), _os._exit(130)))

import argparse
import sys
from typing import Optional, Sequence

from polestar_jax import cli
from polestar_jax.errors import PolestarError

DTYPE_CHOICES = ("bfloat16", "float32")


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="python -m polestar_jax.convert",
                description="Convert an HF LLaDA or Dream checkpoint (safetensors, single or sharded) to an orbax "
                            "folder, or back with --to-hf.")
    p.add_argument("src", metavar="SRC_DIR", help="HF folder (or, with --to-hf, a converted folder)")
    p.add_argument("dst", metavar="OUT_DIR", help="output folder (its params/ and config.json are replaced)")
    p.add_argument("--to-hf", action="store_true", help="export SRC_DIR as an HF safetensors folder")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="cast the weights (default: keep the stored dtype)")
    p.add_argument("--max-shard-mb", type=float, default=None, metavar="N",
                   help="with --to-hf: split the weights into shards of at most N MB (10^6 bytes)")
    return p


def run(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_shard_mb is not None:
        if not args.to_hf:
            parser.error("--max-shard-mb needs --to-hf")
        if not args.max_shard_mb > 0:
            parser.error(f"--max-shard-mb must be positive, got {args.max_shard_mb}")
    cli.need_folder(args.src, "model folder")
    try:
        from polestar_jax.convert.hf import convert_hf_to_orbax, convert_orbax_to_hf

        if args.to_hf:
            max_bytes = None if args.max_shard_mb is None else max(1, int(args.max_shard_mb * 1e6))
            summary = convert_orbax_to_hf(args.src, args.dst, max_shard_bytes=max_bytes, dtype=args.dtype)
            print(summary.line("exported"))
        else:
            summary = convert_hf_to_orbax(args.src, args.dst, dtype=args.dtype)
            print(summary.line("converted"))
    except OSError as e:
        raise PolestarError(str(e)) from None
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli.run_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
