"""Memory planning without weights: sizes of parameters, caches and the compiled block step.

Everything is computed from abstract arrays (``jax.ShapeDtypeStruct``): the parameter pytree from
:func:`polestar_jax.io.checkpoint.param_shapes` (any model family), the decode state from the same constructors
the engine uses, and XLA compiles the block decoder for those shapes and reports its memory analysis. No
weight is read or allocated, so the 8B configuration plans on a laptop CPU.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import jax.numpy as jnp

from polestar_jax.config import DecodeConfig, ModelConfig
from polestar_jax.models import quant


@dataclasses.dataclass
class MemoryPlan:
    param_bytes: int
    kv_bytes_per_seq: int
    hs_bytes_per_seq: int  # Polestar's stored hidden states of the refresh rows (+ int8 scales)
    polestar_other_bytes_per_seq: int  # clusters, proxy attention, drift state
    state_bytes: int  # the whole decode state for the batch
    compiled: Optional[dict]  # XLA memory analysis of the block step (bytes), if compiled
    compile_seconds: float
    bf16: bool = False
    hs_memory: str = "device"  # where the stored hidden states live ("device" or "pinned_host")
    hs_device_transient_bytes_per_seq: int = 0  # most a refreshing layer moves to the device: one layer's encoded rows

    def lines(self) -> list[str]:
        gib = lambda n: f"{n / 2**30:.3f} GiB"
        out = [f"parameters: {gib(self.param_bytes)} ({self.param_bytes:,} bytes)",
               f"KV cache per sequence: {gib(self.kv_bytes_per_seq)}",
               f"hidden states per sequence (Polestar refresh rows): {gib(self.hs_bytes_per_seq)} in "
               f"{self.hs_memory} memory" + (f" (at most {gib(self.hs_device_transient_bytes_per_seq)} "
                                             "crosses to the device per refreshing layer)" if self.hs_memory != "device" else ""),
               f"other Polestar state per sequence: {gib(self.polestar_other_bytes_per_seq)}",
               f"decode state for the batch: {gib(self.state_bytes)}"]
        if self.compiled:
            out.append("compiled block step (XLA memory analysis): " + ", ".join(
                f"{k}={gib(v)}" for k, v in self.compiled.items()))
            out.append(f"compile time: {self.compile_seconds:.1f} s (backend: {jax.default_backend()})")
            if jax.default_backend() == "cpu" and self.bf16:
                out.append("note: XLA:CPU has no bf16 matmul and keeps an f32 copy of the weights in 'temp'; "
                           "a GPU/TPU compilation does not")
        return out


def plan(cfg: ModelConfig, dcfg: DecodeConfig, batch: int = 1, prompt_len: int = 128, dtype="bfloat16",
         compile_step: bool = True, weights: str = "float") -> MemoryPlan:
    """Plans one generation of ``batch`` prompts of ``prompt_len`` tokens (``weights="int8"``: with int8 matmul
    weights, :mod:`polestar_jax.models.quant`)."""
    from polestar_jax.decode.block import EngineSpec, Knobs, decode_block
    from polestar_jax.decode.layout import init_decode_state, own_state
    from polestar_jax.decode.state import tree_bytes

    dt = jnp.dtype(dtype)
    from polestar_jax.io.checkpoint import param_shapes

    # the parameter shapes of cfg's family (Dream adds the q/k/v biases)
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dt), param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    params = jax.eval_shape(lambda p: quant.quantize_params(p, quant.check_mode(weights)), params)
    param_bytes = tree_bytes(params)
    if cfg.vision is not None:  # LLaDA-V: the batch's image-row table (polestar_jax.engine.images) is an input
        params["image_rows"] = jax.ShapeDtypeStruct((batch * prompt_len, cfg.d_model), dt)
    state = init_decode_state(cfg, dcfg, [[0] * prompt_len] * batch, prompt_len, dtype=dt, abstract=True)
    kv = tree_bytes((state.k_cache, state.v_cache)) // batch if state.k_cache is not None else 0
    hs = other = transient = 0
    hs_memory = "device"
    own = own_state(dcfg.decoder)
    if own is not None and state.policy_state is not None:
        mem = own.memory(state.policy_state, batch, own.config_of(dcfg))
        hs, other, hs_memory, transient = mem["stored"], mem["other"], mem["stored_memory"], mem["transient"]
    compiled, secs = None, 0.0
    if compile_step:
        spec = EngineSpec.from_config(cfg, dcfg)
        knobs = Knobs.from_config(dcfg)
        t0 = time.perf_counter()
        exe = jax.jit(decode_block, static_argnames=("spec",)).lower(
            params, state, knobs, None, spec).compile()
        secs = time.perf_counter() - t0
        ma = exe.memory_analysis()
        if ma is not None:
            compiled = {k: int(getattr(ma, k + "_size_in_bytes")) for k in
                        ("argument", "output", "temp", "generated_code") if hasattr(ma, k + "_size_in_bytes")}
    return MemoryPlan(param_bytes, kv, hs, other, tree_bytes(state), compiled, secs, dt == jnp.bfloat16,
                      hs_memory, transient)


@dataclasses.dataclass
class ImageSizePlan:
    """What one image size costs a LLaDA-V prompt."""

    size: tuple[int, int]  # (width, height) in pixels
    grid: tuple[int, int]  # (columns, rows) of 384-pixel tiles (anyres)
    crops: int  # tower inputs: the whole image + the tiles
    tokens: int  # prompt rows the image becomes
    tower_compiled: Optional[dict] = None  # XLA memory analysis of the tower + projector for these crops (bytes)

    def line(self) -> str:
        out = (f"image {self.size[0]}x{self.size[1]}: grid {self.grid[0]}x{self.grid[1]}, {self.crops} crops, "
               f"{self.tokens} prompt tokens")
        if self.tower_compiled:
            out += " (tower: " + ", ".join(f"{k}={v / 2**30:.3f} GiB" for k, v in self.tower_compiled.items()) + ")"
        return out


def plan_images(cfg: ModelConfig, sizes, dtype="bfloat16", compile_tower: bool = True) -> list[ImageSizePlan]:
    """Per image size (``(w, h)`` pixels), the anyres grid, the crops and the prompt tokens of a LLaDA-V model;
    with ``compile_tower`` the XLA memory analysis of its tower and projector over those crops (abstract
    arrays: no weights)."""
    from polestar_jax.io.checkpoint import param_shapes
    from polestar_jax.models import image as img
    from polestar_jax.models import llada_v, vision

    vc, dt = cfg.vision, jnp.dtype(dtype)
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dt), param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    image_side = {k: params[k] for k in ("vision", "projector")}
    compiled: dict[int, Optional[dict]] = {}
    out = []
    for w, h in sizes:
        best = img.select_best_resolution((w, h), vc.grid_pinpoints)
        grid = (best[0] // vc.image_size, best[1] // vc.image_size)
        crops = 1 + grid[0] * grid[1]
        if compile_tower and crops not in compiled:
            px = jax.ShapeDtypeStruct((crops, 3, vc.image_size, vc.image_size), dt)
            exe = jax.jit(lambda p, x: vision.encode(p, x, vc)).lower(image_side, px).compile()
            ma = exe.memory_analysis()
            compiled[crops] = None if ma is None else {
                k: int(getattr(ma, k + "_size_in_bytes")) for k in ("argument", "output", "temp")
                if hasattr(ma, k + "_size_in_bytes")}
        out.append(ImageSizePlan((w, h), grid, crops, llada_v.n_image_rows((w, h), vc), compiled.get(crops)))
    return out
