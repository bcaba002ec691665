"""Sharding over a ``jax.sharding.Mesh`` with axes ``data`` (batch) and ``model`` (tensor parallel).

Parameters: column-parallel q/k/v/gate/up (output features over ``model``), row-parallel attention-out and
down projections (input features over ``model``), vocab-parallel LM head, embedding split over features;
norms replicated. The decode state is sharded with the batch over ``data`` (K/V caches and Polestar's
proxy attention additionally over heads on ``model``). A dimension that the axis size does not divide is
replicated instead, so any mesh works for any model (at some cost). XLA's SPMD partitioner inserts the
collectives; the decode code itself is unchanged.

LLaDA-MoE's experts (``blocks/e_gate``, ``e_up``, ``e_down`` [N, E, ...]) are expert-parallel: the expert axis
splits over ``model`` (device ``j`` holds experts ``j*E/M .. (j+1)*E/M - 1``, each whole), or is replicated
when ``model`` does not divide E; the router and the q/k-norm weights are replicated, attention splits as
above. Each device holds ``E/M`` of the expert weights, the bulk of the model; XLA partitions the grouped
``ragged_dot`` (gathering what it needs), so the answers equal one device's.

Attention heads are never cut (GQA-aware, given the model config): the query side (``wq``, Dream's ``bq``,
``wo``'s input features) is split over ``model`` only when the axis divides the query heads, the key/value
side (``wk``, ``wv``, Dream's ``bk``, ``bv``) and the K/V cache only when it divides the KV heads; otherwise
that side is replicated. With both split, device ``j`` holds query heads ``j*H/M ..`` and exactly the KV
heads they read (KV head ``i // G`` serves query head ``i``), so attention needs no collective. With fewer
KV heads than devices (or a count the axis does not divide: Dream-7B's 4 KV heads on ``model=8``) every
device keeps all KV heads -- the K/V projections are ``KV/H`` of the query projection's size and the cache
is per sequence ``2 N KV hd L`` values -- rather than sharing heads between devices by KV group, which a
one-dimensional ``model`` axis cannot express without cutting heads.

Multi-process (several hosts, or several processes on one host): :func:`join_runtime` joins JAX's own
multi-controller runtime (``jax.distributed.initialize``) before anything touches a device; a mesh then
spans every process's devices, each process holds only its shards (parameters are built shard by shard
from the checkpoint: :func:`polestar_jax.io.checkpoint.load_model` ``shardings=``), every process passes the
same host arrays (prompts, decode state) and :func:`shard` materialises only its local shards of them, and
:func:`to_host` gathers results on every process.
"""
from __future__ import annotations

import os
import socket
import sys
import functools
import threading
from typing import Any, NamedTuple, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from polestar_jax.errors import PolestarError

_PARAM_SPECS = {
    "wte": (None, "model"),
    "lm_head": (None, "model"),
    "ln_f": (None,),
    "attn_norm": (None, None), "ff_norm": (None, None),
    "wq": (None, None, "model"), "wk": (None, None, "model"), "wv": (None, None, "model"),
    "wo": (None, "model", None),
    "w_gate": (None, None, "model"), "w_up": (None, None, "model"),
    "w_down": (None, "model", None),
    "bq": (None, "model"), "bk": (None, "model"), "bv": (None, "model"),  # Dream's q/k/v biases
    # LLaDA-MoE: expert-parallel experts [N, E, ...] (whole experts per device), replicated router and q/k-norm
    "e_gate": (None, "model", None, None), "e_up": (None, "model", None, None), "e_down": (None, "model", None, None),
    "router": (None, None, None), "q_norm": (None, None), "k_norm": (None, None),
}
#: Parameters whose ``model``-split dimension is a stack of attention heads, and the config field that
#: counts them: they split over ``model`` only in whole heads (see the module docstring).
_HEAD_SPLIT = {"wq": "n_heads", "bq": "n_heads", "wo": "n_heads",
               "wk": "n_kv_heads", "wv": "n_kv_heads", "bk": "n_kv_heads", "bv": "n_kv_heads"}


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}`` (raises :class:`PolestarError` when malformed)."""
    out: dict[str, int] = {}
    for part in spec.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in ("data", "model") or not size.strip().isdigit() or int(size) < 1:
            raise PolestarError(f"invalid --mesh {spec!r} (expected e.g. data=2,model=4)")
        out[name] = int(size)
    return out


def make_mesh(spec: str | dict[str, int], devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A (data, model) mesh over the first data*model devices of ``devices`` (default ``jax.devices()``; a
    TPU topology's devices for ahead-of-time compiles: ``bench.tpu_proxy``), taken in that order (process
    by process)."""
    sizes = parse_mesh(spec) if isinstance(spec, str) else dict(spec)
    d, m = sizes.get("data", 1), sizes.get("model", 1)
    devices = list(jax.devices() if devices is None else devices)
    processes = len({dev.process_index for dev in devices})
    if d * m > len(devices):
        raise PolestarError(f"mesh data={d},model={m} needs {d * m} devices, {len(devices)} available")
    if processes > 1 and d * m != len(devices):
        # a process without a device in the mesh would hold no shard and could not take part
        raise PolestarError(f"mesh data={d},model={m} uses {d * m} of the {len(devices)} devices of "
                            f"{processes} processes; a multi-process mesh must use every device")
    # devices are ordered by process: with model <= devices per process, `model` stays within a host
    return Mesh(np.asarray(devices[: d * m]).reshape(d, m), ("data", "model"))


def _fit(shape: tuple[int, ...], axes: tuple, mesh: Mesh) -> P:
    """PartitionSpec ``axes`` with every axis that does not divide its dimension dropped."""
    out = []
    for dim, ax in zip(shape, axes + (None,) * (len(shape) - len(axes))):
        out.append(ax if ax is not None and dim % mesh.shape[ax] == 0 else None)
    return P(*out)


def param_shardings(params: Any, mesh: Mesh, cfg: Any = None) -> Any:
    """NamedShardings for the parameter pytree of a model family (:mod:`polestar_jax.models.llada`; Dream adds
    ``blocks/bq``, ``bk``, ``bv``). With ``cfg`` (its :class:`~polestar_jax.config.ModelConfig`) the attention
    projections split in whole query / KV heads or not at all (module docstring); without it every
    dimension is split by its size alone, which can cut a head."""
    m = mesh.shape.get("model", 1)

    def spec(path, leaf):
        if len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey):  # an int8 weight's q / scale
            path = path[:-1]  # (its scale, size 1 on the split input axis, is replicated there by _fit)
        name = str(getattr(path[-1], "key", path[-1]))
        axes = _PARAM_SPECS.get(name, ())
        if cfg is not None and name in _HEAD_SPLIT and getattr(cfg, _HEAD_SPLIT[name]) % m:
            axes = tuple(None if a == "model" else a for a in axes)
        return NamedSharding(mesh, _fit(leaf.shape, axes, mesh))

    return jax.tree_util.tree_map_with_path(spec, params)


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a DecodeState (or a Replay / any pytree whose leaves lead with the batch), from
    the axes each state field declares (:func:`polestar_jax.decode.state.axes`)."""
    from polestar_jax.axes import axes_of

    return jax.tree.map(lambda leaf, ax: NamedSharding(mesh, _fit(leaf.shape, ax.spec, mesh) if leaf.ndim else P()),
                        tree, axes_of(tree))


def shard(tree: Any, shardings: Any) -> Any:
    """``tree`` placed with ``shardings``. Multi-process: every process passes the same values (host or
    process-local arrays: prompts, the initial decode state) and builds only the shards of its own devices
    from them (``jax.make_array_from_callback``; ``jax.device_put`` would first all-gather each array to
    check that the processes agree); arrays that already span processes are resharded by ``device_put``.
    Abstract leaves (``jax.ShapeDtypeStruct``: ahead-of-time compiles) become shape structs with their sharding."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree)):
        return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings)
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x, sh):
        if sh.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, sh)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sh, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


# ---------------------------------------------------------------------------------- multi-process join

#: Seconds :func:`join_runtime` waits for the coordinator and every process by default
#: (``$POLESTAR_JAX_JOIN_TIMEOUT`` overrides it).
JOIN_TIMEOUT_S = 300.0


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    if v is None or not v.strip():
        return None
    try:
        return int(v)
    except ValueError:
        raise PolestarError(f"{name}={v!r} is not an integer") from None


def _joined() -> bool:
    from polestar_jax import compat

    return compat.distributed_joined()


def _detected_cluster() -> Optional[str]:
    """The cluster environment ``jax.distributed.initialize()`` would auto-detect (SLURM, Open MPI, a
    Cloud TPU slice, Kubernetes), when it reports more than one process; None otherwise (a plain machine,
    or a single-process job inside a cluster, which has nothing to join)."""
    import warnings

    from polestar_jax import compat

    kinds = compat.cluster_env_types()  # JAX's own registry of cluster environments
    if not kinds:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "Kubernetes detected but the kubernetes package is missing"
        for kind in kinds:
            try:
                if kind.is_env_present() and int(kind.get_process_count()) > 1:
                    return kind.__name__
            except Exception:  # noqa: BLE001 - an environment that cannot answer is not ours to join
                continue
    return None


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PolestarError(f"invalid coordinator address {address!r} (expected HOST:PORT, e.g. 10.0.0.1:1234)")
    return host.strip("[]"), int(port)


def _why_not_joined(address: str, process_id: Optional[int], num_processes: Optional[int], seconds: float) -> str:
    who = f"process {process_id} of {num_processes}" if process_id is not None else "this process"
    if address and process_id != 0:
        try:
            host, port = _split_address(address)
            socket.create_connection((host, port), timeout=2.0).close()
        except (OSError, PolestarError) as e:
            return (f"cannot reach the coordinator {address} within {seconds:g} s ({who}: "
                    f"{getattr(e, 'strerror', None) or e}); is process 0 started and the port open?")
    return (f"not every process joined the coordinator {address or '(auto-detected)'} within {seconds:g} s "
            f"({who}); start all {num_processes or ''} processes with the same coordinator and process count")


class _JoinSettings(NamedTuple):
    """What :func:`join_runtime` joins: the coordinator ``HOST:PORT``, the process count and this process's id
    (None where JAX is to detect it), and the name of the cluster environment JAX detected when nothing was
    configured (None otherwise)."""

    coordinator: Optional[str]
    num_processes: Optional[int]
    process_id: Optional[int]
    cluster: Optional[str] = None


def _join_settings(coordinator: Optional[str], num_processes: Optional[int],
                   process_id: Optional[int]) -> Optional[_JoinSettings]:
    """The join the arguments describe, else ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
    ``JAX_PROCESS_ID``, else a cluster of more than one process that JAX detects; None when there is nothing
    to join (nothing set and no such cluster, or a single process). Raises :class:`PolestarError` for
    invalid or incomplete settings (a detected cluster may fill in what is missing)."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if coordinator is None and num_processes is None and process_id is None:
        cluster = _detected_cluster()
        return None if cluster is None else _JoinSettings(None, None, None, cluster)
    if num_processes is not None and num_processes < 1:
        raise PolestarError(f"the number of processes must be >= 1, got {num_processes}")
    if num_processes == 1 and process_id in (None, 0):
        return None  # one process: nothing to join
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise PolestarError(f"process id {process_id} is not in [0, {num_processes})")
    if None in (coordinator, num_processes, process_id) and _detected_cluster() is None:
        missing = [flag for flag, v in (("--coordinator / JAX_COORDINATOR_ADDRESS", coordinator),
                                        ("--num-processes / JAX_NUM_PROCESSES", num_processes),
                                        ("--process-id / JAX_PROCESS_ID", process_id)) if v is None]
        raise PolestarError(f"a multi-process run needs {' and '.join(missing)} (no cluster to detect them from)")
    if coordinator is not None:
        _split_address(coordinator)
    return _JoinSettings(coordinator, num_processes, process_id)


def _check_devices_unused() -> None:
    """Raises :class:`PolestarError` when JAX has already set up its backends in this process (a runtime
    can only be joined before anything uses a device)."""
    from polestar_jax import compat

    if compat.backends_initialized():
        raise PolestarError("cannot join a multi-process runtime: JAX already uses its devices in this process "
                            "(join first: polestar_jax.sharding.join_runtime() before any jax computation)")


def _join_timeout(timeout: Optional[float]) -> float:
    """``timeout``, else ``$POLESTAR_JAX_JOIN_TIMEOUT``, else :data:`JOIN_TIMEOUT_S` (seconds, > 0)."""
    if timeout is None:
        env = os.environ.get("POLESTAR_JAX_JOIN_TIMEOUT")
        try:
            timeout = float(env) if env else JOIN_TIMEOUT_S
        except ValueError:
            raise PolestarError(f"POLESTAR_JAX_JOIN_TIMEOUT={env!r} is not a number of seconds") from None
    if not timeout > 0:
        raise PolestarError(f"the join timeout must be > 0 s, got {timeout}")
    return float(timeout)


def _initialize(settings: _JoinSettings, timeout: float) -> None:
    """``jax.distributed.initialize`` under a watchdog: when the coordinator and every process have not
    met within ``timeout`` s, the process writes one ``error: ...`` line to stderr and ends with status 2
    (JAX's own, later timeout aborts with a stack trace). JAX's errors become :class:`PolestarError`."""
    coordinator, num_processes, process_id, cluster = settings
    done = threading.Event()

    def watchdog():
        if not done.wait(timeout):
            msg = _why_not_joined(coordinator or "", process_id, num_processes, timeout)
            try:
                sys.stdout.flush()
            except Exception:  # noqa: BLE001
                pass
            os.write(2, f"error: {msg}\n".encode())
            os._exit(2)

    threading.Thread(target=watchdog, name="polestar-join-watchdog", daemon=True).start()
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   initialization_timeout=int(timeout) + 60)
    except (RuntimeError, ValueError, TypeError) as e:
        detail = " ".join(str(e).split())[:300]
        raise PolestarError(f"cannot join the multi-process runtime ({cluster or coordinator}): {detail}") from None
    finally:
        done.set()


def join_runtime(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
                 process_id: Optional[int] = None, timeout: Optional[float] = None) -> bool:
    """Joins JAX's multi-process runtime (``jax.distributed.initialize``); call it before anything uses a
    device. Returns whether this process is now part of a multi-process runtime.

    The coordinator ``HOST:PORT``, the process count and this process's id come from the arguments, else
    ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``; with none of them set, a
    cluster JAX detects itself (SLURM, Open MPI, a Cloud TPU slice, Kubernetes) is joined when it has more
    than one process, and nothing happens otherwise. Process 0 runs the coordinator (it listens on
    ``PORT``). On the CPU backend, the gloo collectives are selected (cross-process collectives need them).

    ``timeout`` (default ``$POLESTAR_JAX_JOIN_TIMEOUT`` or 300 s) bounds the wait for the coordinator and
    every process: past it, the process prints one ``error: ...`` line on stderr and ends with status 2
    (JAX itself would abort with a stack trace). Calling it again, or after ``jax.distributed.initialize``,
    returns True. Raises :class:`PolestarError` for invalid or incomplete settings, or when JAX already
    uses its devices.
    """
    if _joined():
        return True
    settings = _join_settings(coordinator, num_processes, process_id)
    if settings is None:
        return False
    _check_devices_unused()
    seconds = _join_timeout(timeout)
    if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # (a user's "mpi" is kept)
    _initialize(settings, seconds)
    return True


def maybe_initialize_distributed() -> bool:
    """Former name of :func:`join_runtime` (from the environment only)."""
    return join_runtime()


def is_leader() -> bool:
    """True in process 0 (the process that prints results), and in a single-process run."""
    return jax.process_index() == 0


@functools.partial(jax.jit, static_argnames=("mesh",))
def _replicate(xs: tuple, mesh: Mesh) -> tuple:
    """``xs`` replicated over ``mesh`` (one program per mesh and shapes: jit's own cache)."""
    rep = NamedSharding(mesh, P())
    return tuple(jax.lax.with_sharding_constraint(x, rep) for x in xs)


def to_host(tree: Any) -> Any:
    """Fetches a pytree of (possibly multi-process) arrays to numpy, on every process. Arrays with shards
    on other processes are replicated by one compiled program per mesh (all of them at once, not one
    program per leaf as ``process_allgather``), then copied; local ones are copied."""
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict = {}
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            groups.setdefault(getattr(x.sharding, "mesh", None), []).append(i)
    out = list(leaves)
    for mesh, idx in groups.items():
        xs = [leaves[i] for i in idx]
        if isinstance(mesh, Mesh):
            xs = _replicate(tuple(xs), mesh)
        else:  # another kind of sharding
            from jax.experimental import multihost_utils

            xs = [multihost_utils.process_allgather(x, tiled=True) for x in xs]
        for i, x in zip(idx, xs):
            out[i] = x
    fetched = [np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) and not x.is_fully_addressable
               else x for x in out]
    return jax.device_get(jax.tree.unflatten(treedef, fetched))


def mesh_or_none(spec: Optional[str]) -> Optional[Mesh]:
    return make_mesh(spec) if spec else None
