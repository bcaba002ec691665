"""LLaDA-MoE (inclusionAI's LLaDA-MoE-7B-A1B) as pure functions over a parameter pytree.

A LLaDA-style bidirectional masked-diffusion transformer whose MLP is a sparse mixture of experts
(``MOE_SPEC.md``; the HF remote code ``modeling_lladamoe.py``). Per layer, pre-norm:

    x = x + Wo Attn(RoPE(qnorm(Wq h)), RoPE(knorm(Wk h)), Wv h),   h = RMSNorm(x)
    x = x + sum_{e in topk(p)} p_e * down_e(silu(gate_e(h')) * up_e(h')),   h' = RMSNorm(x),
                                                          p = softmax(h' Wr) (float32), not renormalised
    logits = RMSNorm(x) @ lm_head                      (untied)

What is LLaDA's here (:mod:`polestar_jax.models.llada`): the layer itself (:func:`llada.layer` with this
family's projections and MLP), RMSNorm, rotate-half RoPE, attention, embedding and head. What differs:

* q/k-norm (``qk_layernorm``): an RMSNorm over each head's ``hd`` features with one ``[hd]`` weight shared by
  all heads, before RoPE; the K/V cache holds the normed, un-rotated keys (what :func:`project_kv` returns).
* The MoE block (:func:`moe_mlp`): router logits in the activation dtype, softmax and top-k in float32, the
  top-k probabilities cast back and used as they are: never renormalised, whatever the config's
  ``norm_topk_prob`` says (the reference hard-codes it off; a config that sets it gets one warning).
  Tokens are grouped by expert and each expert's weights are read once per call
  (:func:`grouped_experts`, ``jax.lax.ragged_dot``); every token's output is independent of which other
  tokens share the call, so batching, padding rows and refreshed-row subsets change nothing.

Parameters: LLaDA's pytree without the dense MLP, plus per layer ``blocks/q_norm``, ``blocks/k_norm`` [N, hd]
(with ``qk_norm``), ``blocks/router`` [N, D, E] and the stacked experts ``blocks/e_gate``, ``blocks/e_up``
[N, E, D, F] and ``blocks/e_down`` [N, E, F, D] (``F`` = ``mlp_hidden_size``, the expert intermediate size;
linear weights ``[in, out]``); the HF names map onto it in :mod:`polestar_jax.io.checkpoint`.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from polestar_jax.config import ModelConfig
from polestar_jax.models import llada, quant

embed = llada.embed
lm_head = llada.lm_head
Rope, Keys, LayerOut, ForwardOut = llada.Rope, llada.Keys, llada.LayerOut, llada.ForwardOut


def project_q(lp: llada.LayerParams, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Input norm, query projection and (``qk_norm``) the per-head q-norm of rows ``h`` [b, T, D]:
    q [b, H, T, hd] (un-rotated)."""
    q = llada.project_q(lp, h, cfg)  # [b, H, T, hd]
    return llada.rms_norm(q, lp["q_norm"], cfg.rms_norm_eps) if cfg.moe.qk_norm else q


def project_kv(lp: llada.LayerParams, h: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Key / value projections with the per-head k-norm on the keys: k, v [b, KV, T, hd] (un-rotated, what
    the cache stores)."""
    k, v = llada.project_kv(lp, h, cfg)  # [b, KV, T, hd] each
    return (llada.rms_norm(k, lp["k_norm"], cfg.rms_norm_eps) if cfg.moe.qk_norm else k), v


def route(router: jax.Array, x: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The router of normed rows ``x`` [M, D] with weight ``router`` [D, E]: the logits [M, E] (``x.dtype``),
    and the top-k experts [M, k] (int32, by descending probability) with their softmax probabilities
    [M, k] (float32 softmax over all experts, cast to ``x.dtype``, not renormalised)."""
    logits = x @ router  # [M, E]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weight, idx = lax.top_k(probs, top_k)  # [M, k]
    return logits, idx.astype(jnp.int32), weight.astype(x.dtype)


def _grouped(x: jax.Array, weight: jax.Array, idx: jax.Array, w_gate: jax.Array, w_up: jax.Array,
             w_down: jax.Array) -> jax.Array:
    """:func:`grouped_experts` on one set of tokens (no mapped axis)."""
    m, k = idx.shape
    flat = idx.reshape(-1)  # [M*k] expert of every (token, slot)
    order = jnp.argsort(flat, stable=True)  # [M*k] the assignments grouped by expert
    sizes = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)  # [E]
    xs = jnp.take(x, order // k, axis=0)  # [M*k, D]
    hid = jax.nn.silu(lax.ragged_dot(xs, w_gate, sizes)) * lax.ragged_dot(xs, w_up, sizes)  # [M*k, F]
    ys = lax.ragged_dot(hid, w_down, sizes) * jnp.take(weight.reshape(-1), order)[:, None]  # [M*k, D]
    back = jnp.take(ys, jnp.argsort(order), axis=0).reshape(m, k, -1)  # [M, k, D] in (token, slot) order
    # summed in expert-index order, as the reference's index_add_ over experts 0..E-1 (rounding only)
    return jnp.sum(jnp.take_along_axis(back, jnp.argsort(idx, axis=-1)[..., None], axis=1), axis=1)


@jax.custom_batching.custom_vmap
def _grouped_rows(x, weight, idx, w_gate, w_up, w_down):
    return _grouped(x, weight, idx, w_gate, w_up, w_down)


@_grouped_rows.def_vmap
def _grouped_rows_vmap(axis_size: int, in_batched: list, x, weight, idx, w_gate, w_up, w_down):
    full = lambda a, batched: a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
    if any(in_batched[3:]):  # experts that differ per mapped element: one call each
        args = [full(a, bt) for a, bt in zip((x, weight, idx, w_gate, w_up, w_down), in_batched)]
        return lax.map(lambda a: _grouped_rows(*a), args), True
    x, weight, idx = (full(a, bt) for a, bt in zip((x, weight, idx), in_batched[:3]))
    k, d = idx.shape[-1], x.shape[-1]
    out = _grouped_rows(x.reshape(-1, d), weight.reshape(-1, k), idx.reshape(-1, k), w_gate, w_up, w_down)
    return out.reshape(x.shape), True


@jax.custom_vjp
def grouped_experts(x: jax.Array, weight: jax.Array, idx: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                    w_down: jax.Array) -> jax.Array:
    """``sum_j weight[t, j] * E_{idx[t, j]}(x[t])`` for tokens ``x`` [M, D], experts ``idx`` [M, k] and
    weights [M, k], with SwiGLU experts ``w_gate`` / ``w_up`` [E, D, F] and ``w_down`` [E, F, D]: the M*k
    assignments are sorted by expert and each projection is one ``jax.lax.ragged_dot`` over the expert
    groups, so each expert's weights are read once. Returns [M, D] in ``x.dtype``.

    Under ``jax.vmap`` (the running batch's per-row program) the mapped axis is folded into the tokens
    (``ragged_dot`` has no batching rule; tokens are independent, so the result is the same). Differentiable
    in everything but ``idx`` (the backward pass is ``ragged_dot``'s own; training a test bed).

    Lowering: on GPU / TPU ``ragged_dot`` is XLA's grouped ``ragged-dot`` instruction; on the CPU JAX lowers it
    by a masked dense product over the groups (E times the FLOPs of the grouped one; same results)."""
    return _grouped_rows(x, weight, idx, w_gate, w_up, w_down)


def _grouped_experts_fwd(x, weight, idx, w_gate, w_up, w_down):
    return _grouped_rows(x, weight, idx, w_gate, w_up, w_down), (x, weight, idx, w_gate, w_up, w_down)


def _grouped_experts_bwd(res, g):
    x, weight, idx, w_gate, w_up, w_down = res
    _, vjp = jax.vjp(lambda a, w, b, c, e: _grouped(a, w, idx, b, c, e), x, weight, w_gate, w_up, w_down)
    dx, dw, dg, du, dd = vjp(g)
    return dx, dw, np.zeros(idx.shape, jax.dtypes.float0), dg, du, dd


grouped_experts.defvjp(_grouped_experts_fwd, _grouped_experts_bwd)


def moe_mlp(lp: llada.LayerParams, xn: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The MoE block of normed rows ``xn`` [b, T, D] (the :func:`llada.layer` ``mlp``): route every row to its
    top-k experts and mix their outputs with the raw top-k probabilities. Returns [b, T, D]."""
    if cfg.moe.norm_topk_prob:  # (at trace time; Python shows a warning once per place)
        warnings.warn("LLaDA-MoE: config sets norm_topk_prob=true, which the reference ignores: the top-k routing "
                      "weights are not renormalised (docs/differences.md)", stacklevel=1)
    b, t, d = xn.shape
    x = xn.reshape(b * t, d)  # [M, D]
    _, idx, weight = route(lp["router"], x, cfg.moe.top_k)
    # int8 experts: this layer's experts dequantized here (ragged_dot takes float groups; quant module docstring)
    experts = (quant.dequantize(lp[k], xn.dtype) for k in ("e_gate", "e_up", "e_down"))
    return grouped_experts(x, weight, idx, *experts).reshape(b, t, d)


#: One LLaDA-MoE layer: :func:`polestar_jax.models.llada.layer` with q/k-norm and the MoE block (same signature).
layer = functools.partial(llada.layer, q_proj=project_q, kv_proj=project_kv, mlp=moe_mlp)
#: All layers: :func:`polestar_jax.models.llada.forward` over :data:`layer` (same signature).
forward = functools.partial(llada.forward, layer_fn=layer)


def routing(params: llada.Params, ids: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What the router decides in a plain forward over ``ids`` [b, L] (positions 0..L-1), per layer:
    router logits [N, b*L, E], selected experts [N, b*L, k] (descending weight) and their weights
    [N, b*L, k]; a diagnostic (golden ``router_*.npz``), not used by any decoder."""
    b, length = ids.shape
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    rope = Rope.at(pos, cfg)
    hidden = forward(params, ids, cfg, pos, pos, None, collect_hidden=True).hidden  # [N, b, L, D]

    def one(_, xs):
        lp, h = xs
        # the layer with a zero MLP gives the residual stream after attention, bit for bit (h + 0)
        mid = llada.layer(lp, h, cfg, rope, rope, None, q_proj=project_q, kv_proj=project_kv,
                          mlp=lambda lp_, xn, cfg_: jnp.zeros_like(xn)).h  # [b, L, D]
        xn = llada.rms_norm(mid, lp["ff_norm"], cfg.rms_norm_eps).reshape(b * length, -1)
        return None, route(lp["router"], xn, cfg.moe.top_k)

    _, (logits, idx, weight) = lax.scan(one, None, (params["blocks"], hidden))
    return logits, idx, weight


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32, std: float = 0.02) -> llada.Params:
    """Random LLaDA-MoE parameters in the layout above (tests, benchmarks; not a trained model)."""
    params = llada.init_params(cfg, key, dtype, std)
    blocks = {k: v for k, v in params["blocks"].items() if k not in ("w_gate", "w_up", "w_down")}
    n, d, f, e, hd = cfg.n_layers, cfg.d_model, cfg.mlp_hidden_size, cfg.moe.n_experts, cfg.head_dim
    ks = jax.random.split(jax.random.fold_in(key, 2), 4)
    nrm = lambda k, shape: (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    blocks.update(router=nrm(ks[0], (n, d, e)), e_gate=nrm(ks[1], (n, e, d, f)), e_up=nrm(ks[2], (n, e, d, f)),
                  e_down=nrm(ks[3], (n, e, f, d)))
    if cfg.moe.qk_norm:
        blocks.update(q_norm=jnp.ones((n, hd), dtype), k_norm=jnp.ones((n, hd), dtype))
    return {**params, "blocks": blocks}
