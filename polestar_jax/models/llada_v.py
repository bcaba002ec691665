"""LLaDA-V, the vision-language model family: image rows spliced into the prompt of a LLaDA LM.

An image becomes prompt rows in three steps: the pixels (:mod:`polestar_jax.models.image`: crop 0 = the
whole image, then the ``anyres`` grid tiles), the projected tower features of every crop
(:func:`polestar_jax.models.vision.encode`: [n, T, D], ``T = side^2`` = 729), and the splicing here
(``spatial_unpad`` with ``anyres_max_N``), for an image of ``(w, h)`` pixels on a grid of ``nW x nH``
tiles:

    base = f[0]                                   (T rows: the squashed whole image)
    g    = the tiles' features as one [nH*side, nW*side, D] picture (tile rows, then patch rows)
    g    = g without the letterbox rows (or columns) that the padding to the grid added (:func:`unpad_bounds`)
    if sqrt(h'*w' / (N * side^2)) = t > 1.1:  g = bilinear resize of g to (int(h' // t), int(w' // t))
    rows = base ++ flatten_row_major(g with image_newline appended as a last column)

Each ``IMAGE_TOKEN_INDEX`` (-200) of the prompt ids is replaced by its image's rows, the text between
embedded with the LM's table, and the result cut to ``VisionConfig.model_max_length``
(:func:`splice`). These rows are the prompt: the LM (LLaDA-8B in the HF Llama layout, no biases) is
:func:`polestar_jax.models.llada.forward` called with ``embeds=`` the prompt rows ++ the embedded
generated ids, the same layer, RoPE, RMSNorm and head as LLaDA (:func:`polestar_jax.models.llada.layer`);
its K/V cache layout is LLaDA's.

For the decoders, which hold token ids, :func:`with_image_rows` turns a batch's image placeholders into
ids past the embedding (``E + j``) and puts the batch's image rows in ``params["image_rows"]``; the
family's :func:`embed` (and so :func:`forward`) reads them, so every decoder treats image rows as prompt
rows. The family's decoding heads never commit the four ids the official sampler excludes
(:data:`SUPPRESS_IDS`).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from polestar_jax.config import ModelConfig, VisionConfig
from polestar_jax.errors import PolestarError
from polestar_jax.models import image as img
from polestar_jax.models import llada
from polestar_jax.models import vision

#: The placeholder id of ``<image>`` in prompt ids (LLaVA's ``IMAGE_TOKEN_INDEX``).
IMAGE_TOKEN_INDEX = -200

#: The ids the official sampler never commits (LLaDA's bos, eos and header markers; hard-coded there): their
#: logits are suppressed in every decoding head (``Family.suppress_ids``).
SUPPRESS_IDS = (126080, 126081, 126346, 126347)

# The LM is LLaDA's (Llama layout, no biases).
layer, project_q, project_kv, lm_head = llada.layer, llada.project_q, llada.project_kv, llada.lm_head


def embed(params: dict, ids: jax.Array) -> jax.Array:
    """Input rows of ``ids`` [b, T]: token embeddings, and for an id ``E + r`` (``E`` = the embedding's rows)
    row ``r`` of ``params["image_rows"]`` [R, D] when the parameters carry spliced image rows
    (:func:`with_image_rows`): how the decoders see an image's rows as prompt rows. [b, T, D]."""
    wte = params["wte"]
    h = llada.take_rows(wte, jnp.minimum(ids, wte.shape[0] - 1))
    rows = params.get("image_rows")
    if rows is None:
        return h
    r = jnp.take(rows, jnp.clip(ids - wte.shape[0], 0, rows.shape[0] - 1), axis=0)
    return jnp.where((ids >= wte.shape[0])[..., None], r.astype(h.dtype), h)


def forward(params: dict, ids: Optional[jax.Array], cfg: ModelConfig, *args: Any, embeds=None, **kw: Any):
    """:func:`polestar_jax.models.llada.forward` over the rows :func:`embed` gives (or ``embeds`` [b, T, D])."""
    return llada.forward(params, ids, cfg, *args, embeds=embed(params, ids) if embeds is None else embeds, **kw)


class Layout(NamedTuple):
    """Where an image's rows come from: flat indices ``crop * T + patch`` into its features [n*T, D]."""

    grid: np.ndarray  # [h', w'] int: the unpadded tile picture (before any resize)
    resize: Optional[tuple[int, int]]  # (rows, cols) of the bilinear resize, None when none


def unpad_bounds(shape: tuple[int, int], size: tuple[int, int]) -> tuple[int, int, int, int]:
    """``(r0, r1, c0, c1)``: the part of a [rows, cols] tile picture that shows an image of ``size`` = (w, h)
    (LLaVA's ``unpad_image``: a wider image loses ``pad`` rows at the top and bottom, a taller one columns)."""
    rows, cols = shape
    w, h = size
    if w / h > cols / rows:
        pad = (rows - int(h * (cols / w))) // 2
        return pad, rows - pad, 0, cols
    pad = (cols - int(w * (rows / h))) // 2
    return 0, rows, pad, cols - pad


def layout(size: tuple[int, int], grid: tuple[int, int], vc: VisionConfig) -> Layout:
    """The :class:`Layout` of an image of ``size`` = (w, h) on ``grid`` = (nW, nH) tiles."""
    side, (nw, nh) = vc.patches_per_side, grid
    r = np.arange(nh * side)[:, None]
    c = np.arange(nw * side)[None, :]
    flat = (1 + (r // side) * nw + c // side) * side * side + (r % side) * side + c % side  # [nH*side, nW*side]
    r0, r1, c0, c1 = unpad_bounds(flat.shape, size)
    g = flat[r0:r1, c0:c1]
    times = math.sqrt(g.shape[0] * g.shape[1] / (vc.max_num_patches * side * side))
    resize = (int(g.shape[0] // times), int(g.shape[1] // times)) if times > 1.1 else None
    return Layout(g, resize)


def bilinear_resize(x: jax.Array, rows: int, cols: int) -> jax.Array:
    """x [h, w, D] -> [rows, cols, D]: bilinear with half-pixel centres and no antialiasing (PyTorch's
    ``interpolate(mode="bilinear", align_corners=False)``; the weights in float32)."""

    def axis(n_in, n_out):
        src = jnp.maximum((jnp.arange(n_out, dtype=jnp.float32) + 0.5) * jnp.float32(n_in / n_out) - 0.5, 0.0)
        i0 = jnp.floor(src).astype(jnp.int32)
        i1 = jnp.minimum(i0 + 1, n_in - 1)
        lam = src - i0.astype(jnp.float32)
        return i0, i1, lam

    r0, r1, lr = axis(x.shape[0], rows)
    c0, c1, lc = axis(x.shape[1], cols)
    lr, lc = lr[:, None, None].astype(x.dtype), lc[None, :, None].astype(x.dtype)
    top = (1 - lc) * x[r0][:, c0] + lc * x[r0][:, c1]
    bot = (1 - lc) * x[r1][:, c0] + lc * x[r1][:, c1]
    return (1 - lr) * top + lr * bot


def image_rows(features: jax.Array, size: tuple[int, int], grid: tuple[int, int], newline: jax.Array,
               vc: VisionConfig) -> jax.Array:
    """The prompt rows of one image from its projected features [n, T, D] (crop 0 first): [R, D]
    (module docstring)."""
    n, t, d = features.shape
    if n != 1 + grid[0] * grid[1]:
        raise PolestarError(f"an image on a {grid[0]}x{grid[1]} grid has {1 + grid[0] * grid[1]} crops, got {n}")
    lay = layout(size, grid, vc)
    flat = features.reshape(n * t, d)
    g = jnp.take(flat, jnp.asarray(lay.grid), axis=0)  # [h', w', D]
    if lay.resize is not None:
        g = bilinear_resize(g, *lay.resize)
    g = jnp.concatenate([g, jnp.broadcast_to(newline.astype(g.dtype), (g.shape[0], 1, d))], axis=1)
    return jnp.concatenate([features[0], g.reshape(-1, d)], axis=0)


def n_image_rows(size: tuple[int, int], vc: VisionConfig) -> int:
    """How many prompt rows an image of ``size`` = (w, h) pixels becomes."""
    best = img.select_best_resolution(size, vc.grid_pinpoints)
    lay = layout(size, (best[0] // vc.image_size, best[1] // vc.image_size), vc)
    h, w = lay.resize or lay.grid.shape
    return vc.patches_per_side ** 2 + h * (w + 1)


def splice(params: dict, ids: Sequence[int], images: Sequence[jax.Array], cfg: ModelConfig) -> jax.Array:
    """The prompt rows [P, D] of prompt ``ids`` (with :data:`IMAGE_TOKEN_INDEX` where an image goes): the
    text embedded, each placeholder replaced by the next of ``images`` (rows [R_i, D], :func:`image_rows`),
    cut to ``cfg.vision.model_max_length`` rows."""
    ids = [int(i) for i in ids]
    at = [k for k, i in enumerate(ids) if i == IMAGE_TOKEN_INDEX]
    if len(at) != len(images):
        raise PolestarError(f"the prompt has {len(at)} image placeholder(s) and {len(images)} image(s)")
    parts, start = [], 0
    for k, rows in zip(at + [len(ids)], list(images) + [None]):
        if k > start:
            parts.append(embed(params, jnp.asarray([ids[start:k]], jnp.int32))[0])
        if rows is not None:
            parts.append(rows.astype(params["wte"].dtype))
        start = k + 1
    if not parts:
        raise PolestarError("empty prompt")
    return jnp.concatenate(parts, axis=0)[:cfg.vision.model_max_length]


def encode_image(params: dict, image: img.ImageLike, cfg: ModelConfig) -> jax.Array:
    """The prompt rows [R, D] of one image (a path or an RGB PIL image): the official pixels, the tower and
    projector (:func:`polestar_jax.models.vision.encoder`: one compiled program per crop count), the splicing."""
    px = img.preprocess(image, cfg.vision)
    feats = vision.encoder(cfg.vision)(params, jnp.asarray(px.pixels, params["projector"]["w1"].dtype))
    return image_rows(feats, px.size, px.grid, params["image_newline"], cfg.vision)


def prompt_embeddings(params: dict, cfg: ModelConfig, ids: Sequence[int],
                      images: Sequence[img.ImageLike] = ()) -> jax.Array:
    """The prompt rows [P, D] of ``ids`` with ``images`` (paths or PIL images) at its placeholders."""
    return splice(params, ids, [encode_image(params, im, cfg) for im in images], cfg)


def with_image_rows(params: dict, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[jax.Array]],
                    cfg: ModelConfig) -> tuple[list[list[int]], dict]:
    """A batch of prompts (ids with :data:`IMAGE_TOKEN_INDEX` placeholders; ``images[r]``: the rows of prompt
    ``r``'s images, :func:`image_rows`) as ids every decoder runs: each placeholder becomes the ids ``E + j``
    (``E`` = the embedding's rows) of its image's rows in one table of all the batch's rows,
    ``params["image_rows"]`` [R, D] (:func:`embed`); each prompt cut to ``cfg.vision.model_max_length``.
    Returns ``(prompts, params with the table)``; a prompt's embedding is :func:`splice`'s rows."""
    e, out, tables = params["wte"].shape[0], [], []
    used = 0
    for ids, rows in zip(prompts, images, strict=True):
        ids = [int(i) for i in ids]
        if sum(i == IMAGE_TOKEN_INDEX for i in ids) != len(rows):
            raise PolestarError(f"a prompt has {sum(i == IMAGE_TOKEN_INDEX for i in ids)} image placeholder(s) "
                                f"and {len(rows)} image(s)")
        it, new = iter(rows), []
        for i in ids:
            if i != IMAGE_TOKEN_INDEX:
                new.append(i)
                continue
            n = next(it).shape[0]
            new.extend(range(e + used, e + used + n))
            used += n
        out.append(new[:cfg.vision.model_max_length])
        tables.extend(r.astype(params["wte"].dtype) for r in rows)
    return out, ({**params, "image_rows": jnp.concatenate(tables)} if tables else params)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32, std: float = 0.02) -> dict:
    """Random LLaDA-V parameters (LLaDA's LM plus a random tower, projector and newline row; tests)."""
    params = llada.init_params(cfg, key, dtype, std)
    leaves, tree = jax.tree.flatten(cfg.vision.param_shapes(cfg.d_model), is_leaf=lambda s: isinstance(s, tuple))
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())  # host draws: no compiles
    drawn = [jnp.asarray(std * rng.standard_normal(s, np.float32), dtype) for s in leaves]
    params.update(jax.tree.unflatten(tree, drawn))
    return params
