"""LLaDA-V's SigLIP vision tower and its ``mlp2x_gelu`` projector, as pure functions over the parameters.

Per crop (pixels [3, S, S], ``S`` = 384, patch ``p`` = 14, ``side`` = S // p = 27 patches a side; the
convolution drops the last ``S - side*p`` pixel rows and columns):

    x = Conv_{p x p, stride p}(pixels) + bias   -> [side*side, C] row-major  + pos_emb
    for each layer:  x = x + out(Attn(LN1(x)));  x = x + fc2(gelu_tanh(fc1(LN2(x))))
    features = x                                 (no post-LayerNorm)

LayerNorm (with bias, ``vc.layer_norm_eps``) and the attention softmax (``hd^-0.5`` scale, no mask) are in
float32. The tower runs the checkpoint's layers: the official loader deletes the SigLIP model's last layer
and takes the output of the last remaining one, without ``post_layernorm`` (whose weights are kept in the
parameters, unused). The projector maps each feature row to the LM width:
``Linear(C, D) -> GELU (exact erf) -> Linear(D, D)``.

Parameters (:func:`polestar_jax.io.checkpoint.param_shapes`; linear weights ``[in, out]``; the vision layer
weights stacked on axis 0, ``Nv`` = ``vc.n_layers``)::

    vision/patch_w [C, 3, p, p] (the convolution, as stored)   vision/patch_b [C]   vision/pos_emb [side^2, C]
    vision/blocks/{ln1,ln2}_{w,b} [Nv, C]   {q,k,v,o}_w [Nv, C, C]   {q,k,v,o}_b [Nv, C]
    vision/blocks/fc1_w [Nv, C, F]  fc1_b [Nv, F]  fc2_w [Nv, F, C]  fc2_b [Nv, C]
    projector/w1 [C, D]  b1 [D]  w2 [D, D]  b2 [D]
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from polestar_jax.config import VisionConfig

Params = dict[str, Any]


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """LayerNorm with bias over the last axis, in float32 (the result in ``x.dtype``): x [..., C]."""
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    return ((xf - mu) * lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def patch_embed(vp: Params, pixels: jax.Array, vc: VisionConfig) -> jax.Array:
    """The patch convolution plus position embeddings: pixels [n, 3, S, S] -> [n, side*side, C]."""
    n, p, side = pixels.shape[0], vc.patch_size, vc.patches_per_side
    x = pixels[:, :, :side * p, :side * p].reshape(n, 3, side, p, side, p)
    x = x.transpose(0, 2, 4, 1, 3, 5).reshape(n, side * side, 3 * p * p)  # [n, T, 3*p*p] (c, kh, kw)
    w = vp["patch_w"].reshape(vp["patch_w"].shape[0], -1)  # [C, 3*p*p]
    x = jnp.einsum("ntk,ck->ntc", x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(w.dtype)
    return x + vp["patch_b"] + vp["pos_emb"]


def tower_layer(lp: Params, x: jax.Array, vc: VisionConfig) -> jax.Array:
    """One SigLIP encoder layer over rows x [n, T, C] (bidirectional, biased projections)."""
    n, t, c = x.shape
    h = layer_norm(x, lp["ln1_w"], lp["ln1_b"], vc.layer_norm_eps)

    def heads(y):  # [n, T, C] -> [n, Hv, T, hd]
        return y.reshape(n, t, vc.n_heads, vc.head_dim).transpose(0, 2, 1, 3)

    q, k, v = (heads(h @ lp[f"{a}_w"] + lp[f"{a}_b"]) for a in "qkv")
    s = jnp.einsum("nhtd,nhsd->nhts", q, k, preferred_element_type=jnp.float32) * (vc.head_dim ** -0.5)
    pr = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    a = jnp.einsum("nhts,nhsd->nhtd", pr, v).transpose(0, 2, 1, 3).reshape(n, t, c)
    x = x + a @ lp["o_w"] + lp["o_b"]
    h = layer_norm(x, lp["ln2_w"], lp["ln2_b"], vc.layer_norm_eps)
    return x + jax.nn.gelu(h @ lp["fc1_w"] + lp["fc1_b"], approximate=True) @ lp["fc2_w"] + lp["fc2_b"]


def tower(vp: Params, pixels: jax.Array, vc: VisionConfig) -> jax.Array:
    """The tower's features of every crop: pixels [n, 3, S, S] -> [n, side*side, C] (the last layer's output,
    no post-LayerNorm)."""
    x = patch_embed(vp, pixels, vc)
    x, _ = lax.scan(lambda h, lp: (tower_layer(lp, h, vc), None), x, vp["blocks"])
    return x


def project(pp: Params, features: jax.Array) -> jax.Array:
    """``mlp2x_gelu``: features [..., C] -> [..., D] (Linear, exact-erf GELU, Linear)."""
    return jax.nn.gelu(features @ pp["w1"] + pp["b1"], approximate=False) @ pp["w2"] + pp["b2"]


def encode(params: Params, pixels: jax.Array, vc: VisionConfig) -> jax.Array:
    """Projected features of every crop of one image: pixels [n, 3, S, S] -> [n, side*side, D]."""
    return project(params["projector"], tower(params["vision"], pixels, vc))


@functools.lru_cache(maxsize=8)
def encoder(vc: VisionConfig) -> Callable[[Params, jax.Array], jax.Array]:
    """:func:`encode` compiled for ``vc``: ``(params, pixels [n, 3, S, S]) -> [n, side*side, D]``, one program
    per crop count (what every caller of the tower shares: the API, the engine, the server, the crosscheck)."""
    return jax.jit(lambda params, pixels: encode(params, pixels, vc))
