"""The model interface the block program calls: what a model family provides to every decoder.

A family is a set of pure functions over its parameter pytree (see :mod:`polestar_jax.models.llada` for LLaDA):

* ``embed(params, ids)`` -> h [b, T, D];
* ``forward(params, ids, cfg, q_pos, key_pos, key_valid, cache=, start=, write=, unroll=)``: all layers;
* ``layer(lp, h, cfg, q_rope, k_rope, key_valid, write=, keys=, return_probs=)`` -> ``llada.LayerOut``:
  the one transformer layer every pass runs (:func:`polestar_jax.models.llada.layer`);
* ``project_q`` / ``project_kv``: the layer's query and key/value halves (Polestar's refresh stages and
  proxy queries use them);
* ``lm_head(params, h, cfg)`` -> float32 logits;
* ``cache_shape(cfg, b, L)``: the K/V cache layout of one layer stack (KV heads, not expanded heads);
* ``logit_shift``: which row of a forward's input span predicts a position: 0 (LLaDA: row p predicts p)
  or 1 (row p-1 predicts p; the span's first row predicts its own position too). :meth:`Family.head_at`
  applies it, so no decoder needs to know which family it runs.

Four families are implemented (:data:`FAMILIES`): LLaDA, Dream, LLaDA-MoE and LLaDA-V; another is a new
model module and one :func:`register_family` call, and its config names it in ``ModelConfig.family``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from polestar_jax.models import llada
from polestar_jax.models import dream
from polestar_jax.models import llada_v
from polestar_jax.models import llada_moe
from polestar_jax.config import ModelConfig
from polestar_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    embed: Callable[..., jax.Array]
    layer: Callable[..., Any]
    forward: Callable[..., Any]  # all layers (llada.forward's signature)
    project_q: Callable[..., jax.Array]
    project_kv: Callable[..., tuple]
    lm_head: Callable[..., jax.Array]
    logit_shift: int = 0
    #: token ids no decoder commits (their logits set to a large negative value in :meth:`head_at`;
    #: LLaDA-V's official sampler hard-codes four, ``llada_v.SUPPRESS_IDS``)
    suppress_ids: tuple = ()
    #: PolestarConfig fields in which this family's official Polestar code differs from the defaults
    #: (LLaDA's): ``(name, value)`` pairs, applied by :meth:`polestar_config`.
    polestar_defaults: tuple = ()

    def polestar_config(self, **given):
        """The :class:`~polestar_jax.config.PolestarConfig` of this family's official Polestar code, with the
        fields in ``given`` overriding it."""
        from polestar_jax.config import PolestarConfig

        return PolestarConfig(**{**dict(self.polestar_defaults), **given})

    def cache_shape(self, cfg: ModelConfig, b: int, length: int) -> tuple[int, ...]:
        """[N, b, KV, L, hd]: K (or V) of every layer (keys before or after RoPE: ``llada.layer``'s
        ``rotated_cache``)."""
        return (cfg.n_layers, b, cfg.n_kv_heads, length, cfg.head_dim)

    def head_rows(self, h: jax.Array, start, length: int) -> jax.Array:
        """The rows [b, length, D] of a forward's input span ``h`` [b, T, D] whose logits predict positions
        ``start .. start+length-1`` (relative to the span), with the family's logit alignment."""
        if self.logit_shift == 0:
            return jax.lax.dynamic_slice_in_dim(h, start, length, axis=1)
        return jnp.take(h, jnp.clip(start + jnp.arange(length) - self.logit_shift, 0, h.shape[1] - 1), axis=1)

    def suppress(self, logits: jax.Array, rows: Optional[int] = None) -> jax.Array:
        """``logits`` [..., V] with the family's never-committed ids (``suppress_ids``) set very low (``rows``:
        on the first ``rows`` rows of ``logits`` [b, T, V] only, in place)."""
        ids = [i for i in self.suppress_ids if i < logits.shape[-1]]
        if not ids:
            return logits
        at = (slice(None), slice(0, rows)) if rows is not None else (Ellipsis,)
        return logits.at[at + (jnp.asarray(ids, jnp.int32),)].set(-1e30)

    def head_at(self, params, h: jax.Array, cfg: ModelConfig, start, length: int) -> jax.Array:
        """Logits [b, length, V] predicting positions ``start .. start+length-1`` of a forward's input span
        ``h`` [b, T, D] (positions relative to the span), with the family's logit alignment."""
        return self.suppress(self.lm_head(params, self.head_rows(h, start, length), cfg))

    def logits(self, params, ids: jax.Array, cfg: ModelConfig, key_valid=None) -> jax.Array:
        """Float32 logits [b, L, V] predicting every position of ``ids`` [b, L] from one plain forward over it
        (positions 0..L-1; keys masked by ``key_valid`` [b, L] when given), with the family's alignment."""
        b, length = ids.shape
        pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
        out = self.forward(params, ids, cfg, pos, pos, key_valid)
        return self.head_at(params, out.h, cfg, 0, length)


#: ``ModelConfig.family`` -> its :class:`Family` (:func:`register_family` adds one).
FAMILIES: Registry[Family] = Registry("model family")


def register_family(family: Family) -> Family:
    """Makes ``family`` known under ``family.name`` (a :class:`ValueError` if the name is taken); returns it."""
    return FAMILIES.register(family.name, family)


LLADA = Family(name="llada", embed=llada.embed, layer=llada.layer, forward=llada.forward,
               project_q=llada.project_q, project_kv=llada.project_kv, lm_head=llada.lm_head, logit_shift=0)

#: Dream (Qwen2 layout, q/k/v biases; :mod:`polestar_jax.models.dream`): trained autoregressively, so row
#: ``p-1`` of a forward's input span predicts position ``p`` (the span's first row also predicts itself).
#: Its official Polestar path clusters a fixed 64 rows back / 32 ahead in full passes, scores clusters with a
#: head-averaged proxy attention, patches K/V with the clustered rows only, and its ``torch.topk`` ranks the
#: two block positions that share a logits row later-first (``docs/algorithm.md#dream``).
DREAM = Family(name="dream", embed=dream.embed, layer=dream.layer, forward=dream.forward,
               project_q=dream.project_q, project_kv=dream.project_kv, lm_head=dream.lm_head,
               logit_shift=1,
               polestar_defaults=(("full_prefix_rows", 64), ("full_suffix_rows", 32), ("proxy_score", "mean"),
                                  ("patch_kv", "clustered"), ("tie_break", "shared_row")))

#: LLaDA-MoE (:mod:`polestar_jax.models.llada_moe`): LLaDA's layer with q/k-norm and routed experts; LLaDA's
#: alignment and Polestar parameters.
LLADA_MOE = Family(name="llada_moe", embed=llada_moe.embed, layer=llada_moe.layer, forward=llada_moe.forward,
                   project_q=llada_moe.project_q, project_kv=llada_moe.project_kv, lm_head=llada_moe.lm_head)

#: LLaDA-V (:mod:`polestar_jax.models.llada_v`): LLaDA's LM in the Llama layout behind a SigLIP tower; its
#: image rows are prompt rows (ids past the embedding read ``params["image_rows"]``; ``forward(..., embeds=)``
#: takes spliced rows directly); four ids are never committed (``suppress_ids``).
LLADA_V = Family(name="llada_v", embed=llada_v.embed, layer=llada_v.layer, forward=llada_v.forward,
                 project_q=llada_v.project_q, project_kv=llada_v.project_kv, lm_head=llada_v.lm_head,
                 logit_shift=0, suppress_ids=llada_v.SUPPRESS_IDS)

register_family(LLADA)
register_family(DREAM)
register_family(LLADA_V)
register_family(LLADA_MOE)


def polestar_config_for(family: Optional[str], decoder: str = "polestar", **given: Any):
    """The :class:`~polestar_jax.config.PolestarConfig` a decoder runs with on a model of ``family``
    (``ModelConfig.family``; None: no family, the plain defaults): for decoder ``polestar`` the family's
    official Polestar parameters (:attr:`Family.polestar_defaults`) with the fields in ``given`` over them;
    other decoders carry ``PolestarConfig(**given)``. The text API, the generate CLI and the lm-eval model
    take their Polestar defaults from here."""
    from polestar_jax.config import PolestarConfig

    if family is None or decoder != "polestar":
        return PolestarConfig(**given)
    return FAMILIES[family].polestar_config(**given)


def family_of(cfg: ModelConfig) -> Family:
    """The :class:`Family` of ``cfg``; a one-line :class:`ConfigError` for an unknown one."""
    return FAMILIES[getattr(cfg, "family", "llada")]
