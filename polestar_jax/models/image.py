"""LLaDA-V's image preprocessing (``anyres_max``), on the host with Pillow, bit for bit the official pixels.

For an RGB image of ``(w, h)`` pixels and a :class:`~polestar_jax.config.VisionConfig` ``vc`` (``S`` =
``vc.image_size``, 384):

1. the grid resolution ``(W, H)`` = :func:`select_best_resolution` over ``vc.grid_pinpoints``: the most
   image pixels kept after a fit-inside scaling (capped at ``w*h``), ties to the least wasted area, further
   ties to the first candidate;
2. the image scaled to fit ``(W, H)`` (:func:`resize_and_pad`: the tighter side filled, the other
   ``min(ceil(x * scale), target)``, Pillow's bicubic), pasted centred on black, cut into ``S x S`` tiles
   row by row;
3. crop 0 is the whole image squashed to ``S x S`` (the aspect ratio is not kept), then the tiles:
   ``n = 1 + (W/S) * (H/S)`` crops;
4. each crop ``x = float32(float64(u8) * (1/255))``, then ``(x - 0.5) / 0.5`` in float32, channels first.

The grid shape ``(W/S, H/S)`` and the original ``(w, h)`` are what the splicing needs
(:mod:`polestar_jax.models.llada_v`). Everything here is numpy / Pillow: no device work.
"""
from __future__ import annotations

import math
import os
from typing import Any, NamedTuple, Sequence, Union

import numpy as np

from polestar_jax.config import VisionConfig
from polestar_jax.errors import PolestarError

ImageLike = Union[str, os.PathLike, Any]  # a path or a PIL image


class Pixels(NamedTuple):
    """One preprocessed image."""

    pixels: np.ndarray  # [n, 3, S, S] float32: crop 0 (the whole image) then the grid tiles, row-major
    size: tuple[int, int]  # (width, height) of the original image
    grid: tuple[int, int]  # (columns, rows) of grid tiles: (W/S, H/S)


def as_rgb(image: ImageLike):
    """A PIL RGB image from ``image`` (a path or a PIL image; other modes are converted as
    ``Image.convert("RGB")`` does). A :class:`PolestarError` (one line) for a file that is not a readable
    image."""
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        try:
            with Image.open(os.fspath(image)) as im:
                im.load()
                return im.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise PolestarError(f"{os.fspath(image)}: not a readable image ({str(e).splitlines()[0]})") from None
    if not isinstance(image, Image.Image):
        raise PolestarError(f"expected an image path or a PIL image, got {type(image).__name__}")
    return image if image.mode == "RGB" else image.convert("RGB")


def select_best_resolution(size: tuple[int, int], candidates: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The ``(width, height)`` among ``candidates`` that keeps the most of an image of ``size`` = (w, h)
    scaled to fit inside it (``min(int(w*s) * int(h*s), w*h)``, ``s`` the fit scale), ties to the smaller
    wasted area, then to the earlier candidate."""
    w, h = size
    best, best_eff, best_waste = None, -1, math.inf
    for cw, ch in candidates:
        s = min(cw / w, ch / h)
        eff = min(int(w * s) * int(h * s), w * h)
        waste = cw * ch - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (cw, ch), eff, waste
    return best


def resize_and_pad(image, target: tuple[int, int]):
    """``image`` (PIL) scaled to fit ``target`` = (W, H) without distortion (Pillow's default bicubic) and
    pasted centred on a black ``W x H`` RGB canvas."""
    from PIL import Image

    w, h = image.size
    tw, th = target
    sw, sh = tw / w, th / h
    if sw < sh:
        nw, nh = tw, min(math.ceil(h * sw), th)
    else:
        nw, nh = min(math.ceil(w * sh), tw), th
    canvas = Image.new("RGB", (tw, th), (0, 0, 0))
    canvas.paste(image.resize((nw, nh)), ((tw - nw) // 2, (th - nh) // 2))
    return canvas


def crops(image, vc: VisionConfig) -> tuple[list[np.ndarray], tuple[int, int]]:
    """The uint8 crops [S, S, 3] of an RGB PIL ``image`` (crop 0 = the whole image squashed, then the grid
    tiles row-major) and the grid shape (columns, rows)."""
    s = vc.image_size
    best = select_best_resolution(image.size, vc.grid_pinpoints)
    padded = resize_and_pad(image, best)
    tiles = [padded.crop((x, y, x + s, y + s)) for y in range(0, best[1], s) for x in range(0, best[0], s)]
    out = [image.resize((s, s))] + tiles
    return [np.asarray(c.resize((s, s)), dtype=np.uint8) for c in out], (best[0] // s, best[1] // s)


def normalize(crop: np.ndarray) -> np.ndarray:
    """uint8 [S, S, 3] -> float32 [3, S, S]: ``float32(float64(u8) * (1/255))``, then ``(x - 0.5) / 0.5``."""
    x = (crop.astype(np.float64) * (1 / 255)).astype(np.float32)
    return ((x - np.float32(0.5)) / np.float32(0.5)).transpose(2, 0, 1)


def preprocess(image: ImageLike, vc: VisionConfig) -> Pixels:
    """The official ``anyres_max`` pixels of ``image`` (a path or a PIL image; module docstring)."""
    im = as_rgb(image)
    cs, grid = crops(im, vc)
    return Pixels(np.ascontiguousarray(np.stack([normalize(c) for c in cs])), tuple(im.size), grid)
