"""Where and how Polestar's hidden-state store lives (:attr:`PolestarConfig.offload_hidden`).

The store holds the layer-input hidden states of the refresh rows, ``[N, b, R, D]`` (``R`` = prefix + suffix
window rows; see :class:`polestar_jax.decode.polestar.state.PolestarState`). It is read and written only by a refresh
step and rewritten by each block-start pass, so it need not sit in device memory:

* ``"none"``: the model dtype in device memory (exact).
* ``"int8"``: symmetric int8 with one float32 scale per row (:func:`polestar_jax.kernels.refresh.quantize_rows`),
  in host memory.
* ``"bf16"``: bfloat16, in host memory.

Placement uses JAX memory kinds: the stored arrays carry ``memory_kind="pinned_host"`` between blocks (the
engine places the initial store there, and the jitted block keeps it there); inside a step the block-start
pass moves each layer's encoded rows to the host as it produces them (``jax.device_put(x,
jax.memory.Space.Host)`` inside the layer scan). A refresh step reads and writes only the rows it selects
(:func:`fetch_rows`, :func:`write_rows`): the row gather / scatter runs on the host
(``compute_on("device_host")``, through :func:`polestar_jax.compat.compute_on_host`) and only the compacted
rows -- at most one layer's ``R`` rows, usually fewer (see :mod:`polestar_jax.decode.polestar.compaction`) -- cross to the
device and back. XLA turns the placements into asynchronous host<->device copies that overlap the layer's
compute (they are the ``annotate_device_placement`` custom calls of the lowered module). Where the backend has no
``pinned_host`` memory -- or on a GPU or a TPU, where XLA did not compile the block program with the store
in host memory (:data:`NO_HOST_STORE_PLATFORMS`) -- the store stays in device memory, still quantised, with a
warning, and the row gather / scatter kernels of :mod:`polestar_jax.kernels.refresh` read and write it in
place.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax.compat import compute_on_host, target_platform
from polestar_jax.config import GPU_PLATFORMS, PolestarConfig
from polestar_jax.kernels.refresh import dequantize_rows, gather_rows, quantize_rows, scatter_rows

HOST_MEMORY_KIND = "pinned_host"

__all__ = ["HOST_MEMORY_KIND", "NO_HOST_STORE_PLATFORMS", "host_store_supported", "host_memory_available",
           "uses_host", "store_dtype", "packed", "store_shape", "encode", "decode", "to_host",
           "fetch_rows", "write_rows", "place_store"]


#: Platforms whose devices have ``pinned_host`` memory but keep the store in device memory: on an H200 (jax
#: 0.11.2) XLA failed to compile the refresh step with the store in host memory (a layout-assignment error
#: on the layer scan's memory-space annotations), while the block start and the plain step compiled
#: (bench/README.md, GPU check); for a TPU (libtpu 0.0.50.1, compiled from a CPU host) the test model's and
#: 2 LLaDA-8B layers' programs compiled with the store's words there, all 32 layers did not (an internal
#: error on the row scales' host computation, batch 1 and 32: docs/kernels.md).
NO_HOST_STORE_PLATFORMS = GPU_PLATFORMS + ("tpu",)


def host_store_supported(dev) -> bool:
    """Whether the store may live in ``dev``'s ``pinned_host`` memory: the device has it and its platform
    is not one of :data:`NO_HOST_STORE_PLATFORMS`."""
    if dev.platform in NO_HOST_STORE_PLATFORMS:
        return False
    return any(m.kind == HOST_MEMORY_KIND for m in dev.addressable_memories())


def host_memory_available(platform: Optional[str] = None) -> bool:
    """Whether the store can be offloaded for programs of ``platform`` (default: the target the engine is
    building for, :func:`polestar_jax.compat.target_platform`, else this process's default backend): not one
    of :data:`NO_HOST_STORE_PLATFORMS`, and its default device has ``pinned_host`` memory (a platform this
    process cannot reach, only compiles for, has none)."""
    return _host_memory_available(platform or target_platform())


@functools.lru_cache(maxsize=None)
def _host_memory_available(platform: Optional[str]) -> bool:
    if platform in NO_HOST_STORE_PLATFORMS:
        return False
    try:
        return host_store_supported(jax.devices(platform)[0] if platform else jax.devices()[0])
    except Exception:  # noqa: BLE001 - a backend without memory spaces, or none in this process
        return False


def uses_host(pc: PolestarConfig) -> bool:
    """True when the store is offloaded and the target can hold it in host memory (:func:`host_memory_available`)."""
    return pc.offload_hidden != "none" and host_memory_available()


def store_dtype(pc: PolestarConfig, model_dtype) -> jnp.dtype:
    """The dtype of the encoded rows (:func:`encode` before :func:`packed` words)."""
    return {"none": jnp.dtype(model_dtype), "int8": jnp.dtype(jnp.int8),
            "bf16": jnp.dtype(jnp.bfloat16)}[pc.offload_hidden]


def packed(pc: PolestarConfig, d: int, model_dtype) -> bool:
    """Whether the store holds its encoded rows of width ``d`` as 32-bit words (:func:`store_shape`): a store
    in host memory does (XLA:TPU lays 8- and 16-bit arrays in host memory out in tiles that its host
    transfers and host computations disagree on: the programs did not compile, ``bench/tpu_proxy.py``), when
    ``d`` of them fill whole words."""
    size = store_dtype(pc, model_dtype).itemsize
    return uses_host(pc) and size < 4 and (d * size) % 4 == 0


def store_shape(pc: PolestarConfig, shape: tuple, model_dtype) -> tuple[tuple, jnp.dtype]:
    """The store array's (shape, dtype) for encoded rows of ``shape`` [..., D]: [..., D * size / 4] uint32
    words where :func:`packed`, else as encoded."""
    dt = store_dtype(pc, model_dtype)
    if packed(pc, shape[-1], model_dtype):
        return tuple(shape[:-1]) + (shape[-1] * dt.itemsize // 4,), jnp.dtype(jnp.uint32)
    return tuple(shape), dt


def _to_words(x: jax.Array) -> jax.Array:
    """[..., D] of an 8- or 16-bit dtype -> uint32 [..., D * size / 4], the same bits."""
    n = 4 // x.dtype.itemsize
    return lax.bitcast_convert_type(x.reshape(x.shape[:-1] + (x.shape[-1] // n, n)), jnp.uint32)


def _from_words(w: jax.Array, dtype) -> jax.Array:
    """Inverse of :func:`_to_words`: uint32 [..., W] -> ``dtype`` [..., W * 4 / size]."""
    x = lax.bitcast_convert_type(w, dtype)
    return x.reshape(x.shape[:-2] + (-1,))


def encode(h: jax.Array, pc: PolestarConfig) -> tuple[jax.Array, jax.Array]:
    """Hidden states ``h`` [..., D] -> (stored [..., D] (32-bit words where :func:`packed`), scale [...]
    float32; zeros unless int8)."""
    if pc.offload_hidden == "int8":
        q, scale = quantize_rows(h)
    else:
        q, scale = h.astype(store_dtype(pc, h.dtype)), jnp.zeros(h.shape[:-1], jnp.float32)
    return (_to_words(q) if packed(pc, h.shape[-1], h.dtype) else q), scale


def decode(stored: jax.Array, scale: jax.Array, pc: PolestarConfig, dtype) -> jax.Array:
    """Inverse of :func:`encode` into ``dtype``."""
    if stored.dtype == jnp.uint32:
        stored = _from_words(stored, store_dtype(pc, dtype))
    if pc.offload_hidden == "int8":
        return dequantize_rows(stored, scale, dtype)
    return stored.astype(dtype)


def to_host(x: jax.Array, pc: PolestarConfig) -> jax.Array:
    """Inside a jitted step: ``x`` placed in host memory when the store is offloaded (else unchanged)."""
    return jax.device_put(x, jax.memory.Space.Host) if uses_host(pc) else x


@compute_on_host
@jax.jit
def _host_take(store: jax.Array, idx: jax.Array) -> jax.Array:
    """Runs on the host: rows ``idx`` [b, w] of ``store`` [b, R, ...] (host memory) -> [b, w, ...]."""
    return jax.vmap(lambda s, i: jnp.take(s, i, axis=0, mode="clip"))(store, idx)


@compute_on_host
@jax.jit
def _host_put(store: jax.Array, idx: jax.Array, rows: jax.Array) -> jax.Array:
    """Runs on the host: ``store`` [b, R, ...] with ``rows`` [b, w, ...] written at ``idx`` [b, w]
    (out-of-range entries dropped)."""
    return jax.vmap(lambda s, i, r: s.at[i].set(r, mode="drop"))(store, idx, rows)


@compute_on_host
@jax.jit
def _host_where(pred: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """Runs on the host: ``a`` where ``pred`` (a scalar or [b, 1, ...] broadcastable), else ``b``."""
    return jnp.where(pred, a, b)


def reshape(a: jax.Array, shape: tuple, pc: Optional[PolestarConfig]) -> jax.Array:
    """Inside a jitted step: ``a.reshape(shape)`` for store arrays (on the host when offloaded, so the array
    stays in host memory)."""
    if pc is not None and uses_host(pc):
        return compute_on_host(jax.jit(lambda x: x.reshape(shape)))(a)
    return a.reshape(shape)


def where(pred: jax.Array, a: jax.Array, b: jax.Array, pc: PolestarConfig) -> jax.Array:
    """Inside a jitted step: ``jnp.where(pred, a, b)`` for store arrays (host memory when offloaded: the
    select runs there)."""
    if uses_host(pc):
        return _host_where(jax.device_put(pred, jax.memory.Space.Host), a, b)
    return jnp.where(pred, a, b)


def fetch_rows(stored: jax.Array, scale: jax.Array, idx: jax.Array, valid: jax.Array, pc: PolestarConfig,
               dtype) -> jax.Array:
    """Inside a jitted step: rows ``idx`` [b, w] of one layer's store (``stored`` [b, R, D], ``scale``
    [b, R]) decoded into ``dtype`` on the device, zero where not ``valid``: [b, w, D].

    With a host store the gather runs on the host (:func:`polestar_jax.compat.compute_on_host`) and only the
    ``w`` gathered rows (and their scales) are copied to the device; otherwise the row gather kernel
    (:func:`polestar_jax.kernels.refresh.gather_rows`, int8 dequantisation fused) reads them in place."""
    if uses_host(pc):
        ih = jax.device_put(idx, jax.memory.Space.Host)
        q = jax.device_put(_host_take(stored, ih), jax.memory.Space.Device)
        s = jax.device_put(_host_take(scale, ih), jax.memory.Space.Device)
        return jnp.where(valid[..., None], decode(q, s, pc, dtype), jnp.zeros((), dtype))
    scales = scale if pc.offload_hidden == "int8" else None
    return gather_rows(stored, idx, valid, scales, dtype=dtype, backend=pc.kernels)


def write_rows(stored: jax.Array, scale: jax.Array, idx: jax.Array, valid: jax.Array, rows: jax.Array,
               pc: PolestarConfig) -> tuple[jax.Array, jax.Array]:
    """Inside a jitted step: one layer's store with ``rows`` [b, w, D] encoded and written at ``idx`` [b, w]
    where ``valid`` (other rows keep their bits). With a host store only the ``w`` encoded rows are copied
    to the host and the scatter runs there; otherwise the row scatter kernel writes them."""
    q, s = encode(rows, pc)
    if uses_host(pc):
        ih = jax.device_put(jnp.where(valid, idx, stored.shape[1]), jax.memory.Space.Host)
        return (_host_put(stored, ih, jax.device_put(q, jax.memory.Space.Host)),
                _host_put(scale, ih, jax.device_put(s, jax.memory.Space.Host)))
    return (scatter_rows(stored, q, idx, valid, backend=pc.kernels),
            scatter_rows(scale, s, idx, valid, backend=pc.kernels))


def place_store(hs: jax.Array, hs_scale: jax.Array, pc: PolestarConfig) -> tuple[jax.Array, jax.Array]:
    """Outside jit: the initial store arrays moved to ``pinned_host`` memory (keeping their sharding) when
    offloading; warns (once per call site, Python's default warning filter) and keeps them in device memory
    where the backend has no host memory kind."""
    if pc.offload_hidden == "none":
        return hs, hs_scale
    if not host_memory_available():
        _warn_no_host()
        return hs, hs_scale
    put = lambda a: jax.device_put(a, a.sharding.with_memory_kind(HOST_MEMORY_KIND))
    return put(hs), put(hs_scale)


def abstract_store(hs, hs_scale) -> tuple:
    """:func:`place_store` for abstract arrays (``jax.ShapeDtypeStruct``): the store placed in host memory
    where the target has it (:func:`host_memory_available`), so an ahead-of-time compile sees the store where
    the engine puts it on that target: a struct with a sharding (a mesh's, a TPU topology's) keeps it, in
    ``pinned_host`` memory; one without is on the default device. Elsewhere it stays in device memory, with
    :func:`place_store`'s warning."""
    if not host_memory_available():
        _warn_no_host()
        return hs, hs_scale

    def put(a):
        sharding = getattr(a, "sharding", None)
        host = (jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=HOST_MEMORY_KIND)
                if sharding is None else sharding.with_memory_kind(HOST_MEMORY_KIND))
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=host)

    return put(hs), put(hs_scale)


def _warn_no_host() -> None:
    """The warning of a store asked for host memory that stays in device memory (for the target's backend)."""
    backend = target_platform() or jax.default_backend()
    why = (f"the Polestar block program does not compile on {backend!r} with the store in '{HOST_MEMORY_KIND}' "
           "memory (an XLA error: docs/kernels.md)" if backend in NO_HOST_STORE_PLATFORMS
           else f"backend {backend!r} has no '{HOST_MEMORY_KIND}' memory")
    warnings.warn(f"{why}: the offloaded Polestar hidden states stay in device memory (still in the offload "
                  "dtype)", RuntimeWarning, stacklevel=3)
