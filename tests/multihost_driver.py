"""One process of a multi-process test pair (tests/test_multihost.py): runs a list of polestar-jax commands in
this one process, so each program is compiled once per pair, not once per command line.

``python tests/multihost_driver.py '<JSON list of commands>'``; each command is ``[kind, *args]``:

* ``generate`` / ``crosscheck`` / ``eval`` / ``bench``: the command line ``args`` of ``python -m
  polestar_jax.<kind>`` (``bench``: ``python -m bench.run``), run through its ``main``; the first command
  joins the multi-process runtime from the environment (``JAX_COORDINATOR_ADDRESS`` ...), the others find it
  joined;
* ``api`` (mesh, prompts): the text API's llada answers ``[[text, nfe], ...]``;
* ``shards`` (mesh, folder): for ``wq`` / ``w_down``, the global and per-device shapes of the shards this
  process holds, and whether they equal the matching slices of the full tensor.

``{process}`` in an argument becomes this process's id. After each command the driver prints one line ``@@ {"kind",
"rc", "seconds", "cpu_seconds" (this process's CPU time, all threads), "value"}`` on stdout, so the lines before it
are what that command printed on stdout. Exit status: the largest of the commands'.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (bench/)

MARK = "@@ "


def _shards(spec: str, folder: str) -> dict:
    import numpy as np

    from polestar_jax import sharding
    from polestar_jax.io.checkpoint import load_model

    mesh = sharding.make_mesh(spec)
    _, full = load_model(folder, dtype="float32")
    _, sh = load_model(folder, dtype="float32", shardings=mesh)
    out = {}
    for key in ("wq", "w_down"):
        a, ref = sh["blocks"][key], np.asarray(full["blocks"][key])
        out[key] = {"global": list(a.shape), "local": [list(s.data.shape) for s in a.addressable_shards],
                    "equal": all(np.array_equal(np.asarray(s.data), ref[s.index]) for s in a.addressable_shards)}
    return out


def _api(spec: str, prompts: list[str]) -> list:
    from polestar_jax.api import load

    return [[r.text, r.nfe] for r in load(mesh=spec).generate(prompts, decoder="llada")]


def _run(kind: str, args: list):
    """(exit status, value) of one command."""
    if kind in ("generate", "crosscheck", "eval"):
        import importlib

        return importlib.import_module(f"polestar_jax.{kind}").main(args), None
    if kind == "bench":
        from bench import run

        return run.main(args), None
    return 0, {"shards": _shards, "api": _api}[kind](*args)


def main() -> int:
    pid = os.environ.get("JAX_PROCESS_ID", "0")
    rcs = []
    for cmd in json.loads(sys.argv[1]):
        kind, args = cmd[0], [a.replace("{process}", pid) if isinstance(a, str) else a for a in cmd[1:]]
        t0, c0 = time.monotonic(), time.process_time()
        rc, value = _run(kind, args)
        rcs.append(rc)
        # sys.stdout, looked up now: after the join it writes to the original stdout (native chatter -> stderr)
        print(MARK + json.dumps({"kind": kind, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
                                 "cpu_seconds": round(time.process_time() - c0, 1), "value": value}), flush=True)
        print(f"[driver {pid}] {kind}: status {rc}, {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return max(rcs)


if __name__ == "__main__":
    sys.exit(main())
