"""Device bytes saved per sequence by Polestar's hidden-state offload at LLaDA-8B shapes (issue #4).

For the 8B configuration (``tests/data/llada8b_config.json``, bf16 weights), block length 32 and generation
lengths 256 and 512 (prompt 256), sizes the decode state of one sequence from abstract arrays
(:func:`polestar_jax.engine.plan.plan`, nothing allocated, nothing compiled) for each ``offload_hidden`` mode and
reports the bytes resident in device memory between refreshes, the bytes moved to host memory, and what
is saved against the exact store (``none``). The accuracy / TPF side of the trade is measured by
``python -m bench.run`` (decoder ``polestar-int8``) on the trained tiny model.

Usage::

    python -m bench.bench_offload [--out DIR]

Writes ``DIR/bench_offload.json`` (default ``bench/results/``) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from bench.common import REPO_ROOT, RESULTS_DIR
from polestar_jax.config import DecodeConfig, ModelConfig, OFFLOAD_HIDDEN, PolestarConfig
from polestar_jax.engine.plan import plan

CONFIG_8B = os.path.join(REPO_ROOT, "tests", "data", "llada8b_config.json")
DEFAULT_OUT = RESULTS_DIR


def rows(config: str = CONFIG_8B, gens=(256, 512), prompt: int = 256, block: int = 32) -> list[dict]:
    cfg = ModelConfig.from_json(config)
    out = []
    for gen in gens:
        base = None
        for mode in OFFLOAD_HIDDEN:
            dc = DecodeConfig(decoder="polestar", gen_length=gen, block_length=block,
                              polestar=PolestarConfig(offload_hidden=mode))
            mp = plan(cfg, dc, batch=1, prompt_len=prompt, dtype="bfloat16", compile_step=False)
            device_state = mp.state_bytes - (mp.hs_bytes_per_seq if mp.hs_memory != "device" else 0)
            r = {"gen_length": gen, "prompt_length": prompt, "block_length": block, "offload_hidden": mode,
                 "hs_bytes": mp.hs_bytes_per_seq, "hs_memory": mp.hs_memory,
                 "hs_device_transient_bytes": mp.hs_device_transient_bytes_per_seq,
                 "kv_bytes": mp.kv_bytes_per_seq, "polestar_other_bytes": mp.polestar_other_bytes_per_seq,
                 "device_state_bytes": device_state}
            if base is None:
                base = r
            r["device_bytes_saved"] = base["device_state_bytes"] - device_state
            r["device_state_saved_frac"] = r["device_bytes_saved"] / base["device_state_bytes"]
            out.append(r)
    return out


def markdown(rs: list[dict]) -> str:
    mib = lambda n: f"{n / 2**20:.2f}"
    lines = ["| gen | offload | HS store MiB | where | device state MiB | saved MiB | saved | transient MiB |",
             "|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in rs:
        lines.append(f"| {r['gen_length']} | {r['offload_hidden']} | {mib(r['hs_bytes'])} | {r['hs_memory']} | "
                     f"{mib(r['device_state_bytes'])} | {mib(r['device_bytes_saved'])} | "
                     f"{100 * r['device_state_saved_frac']:.1f}% | {mib(r['hs_device_transient_bytes'])} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    rs = rows()
    print(markdown(rs))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_offload.json"), "w") as f:
            json.dump(rs, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
