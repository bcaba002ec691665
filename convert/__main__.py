"""Command line of the converter.

    python -m polestar_jax.convert HF_DIR OUT_DIR [--dtype bfloat16|float32]
    python -m polestar_jax.convert --to-hf CONVERTED_DIR OUT_HF_DIR [--max-shard-mb N] [--dtype ...]

Prints a one-line summary on success (exit 0); any user error is one ``error: ...`` line on stderr (exit 2).
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from polestar_jax.errors import PolestarError

DTYPE_CHOICES = ("bfloat16", "float32")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one ``error: ...`` line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {' '.join(message.split())} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m polestar_jax.convert",
                description="Convert an HF LLaDA checkpoint (safetensors) to an orbax folder, or back with --to-hf.")
    p.add_argument("src", metavar="SRC_DIR", help="HF folder (or, with --to-hf, a converted folder)")
    p.add_argument("dst", metavar="OUT_DIR", help="output folder (its params/ and config.json are replaced)")
    p.add_argument("--to-hf", action="store_true", help="export SRC_DIR as an HF safetensors folder")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="cast the weights (default: keep the stored dtype)")
    p.add_argument("--max-shard-mb", type=float, default=None, metavar="N",
                   help="with --to-hf: split the weights into shards of at most N MB (10^6 bytes)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_shard_mb is not None:
        if not args.to_hf:
            parser.error("--max-shard-mb needs --to-hf")
        if not args.max_shard_mb > 0:
            parser.error(f"--max-shard-mb must be positive, got {args.max_shard_mb}")
    try:
        from polestar_jax.convert.hf import convert_hf_to_orbax, convert_orbax_to_hf

        if args.to_hf:
            max_bytes = None if args.max_shard_mb is None else max(1, int(args.max_shard_mb * 1e6))
            summary = convert_orbax_to_hf(args.src, args.dst, max_shard_bytes=max_bytes, dtype=args.dtype)
            print(summary.line("exported"))
        else:
            summary = convert_hf_to_orbax(args.src, args.dst, dtype=args.dtype)
            print(summary.line("converted"))
    except (PolestarError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
