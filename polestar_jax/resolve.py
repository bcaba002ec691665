"""One place that turns a model folder's defaults and a user's options into a :class:`DecodeConfig`.

The command lines (``generate``, ``eval``, ``serve``), the text API and the lm-eval model all resolve their
options here, so the same options give the same configuration everywhere:

* the decoder defaults to ``polestar``; ``cache`` to ``none`` for ``llada``, else ``dual``; ``threshold`` to
  none (the fixed schedule) for ``llada`` and with a ``factor`` rule;
* ``gen_length`` / ``block_length`` default to the model folder's ``generation_config.json`` (else 128 / 32).
  A gen length that is not a multiple of the default block length is refused, unless it is shorter than
  one block: then the block is the gen length, and a note says so (a model trained with one block length
  may answer wrongly with another);
* Polestar knobs start from the model family's values (Dream's official ones, :mod:`polestar_jax.models.family`);
  a Polestar knob with another decoder, ``steps`` with a threshold rule, or a value the configs reject is
  an error (:class:`PolestarError`, one line).
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np

from polestar_jax.config import POLESTAR_DECODERS, DecodeConfig, PolestarConfig
from polestar_jax.errors import PolestarError

#: DecodeConfig fields a user may set by name (``polestar`` takes a whole PolestarConfig).
DECODE_FIELDS = tuple(f.name for f in dataclasses.fields(DecodeConfig) if f.name != "polestar")
#: PolestarConfig fields a user may set by name (decoder ``polestar`` only).
POLESTAR_FIELDS = tuple(f.name for f in dataclasses.fields(PolestarConfig))


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A resolved configuration and the notes that say what the resolution changed (for stderr)."""

    decode: DecodeConfig
    notes: tuple = ()


def type_word(tp) -> str:
    """How an error message names the type ``tp`` ("an integer", "a number", "true or false", "a string")."""
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def check_types(values: Mapping[str, Any], cls, name: Callable[[str], str] = str) -> dict:
    """One-line errors for values of the wrong type (a string where a number belongs, ...)."""
    hints = typing.get_type_hints(cls)
    ok = {int: lambda x: isinstance(x, (int, np.integer)) and not isinstance(x, bool),
          float: lambda x: isinstance(x, (int, float, np.number)) and not isinstance(x, bool),
          bool: lambda x: isinstance(x, (bool, np.bool_)),
          str: lambda x: isinstance(x, str)}
    for key, v in values.items():
        base = hints[key]
        if typing.get_origin(base) is Union:
            if v is None:
                continue
            base = [a for a in typing.get_args(base) if a is not type(None)][0]
        if isinstance(base, type) and issubclass(base, str):  # str and the configs' modes (str enums)
            base = str
        check = ok.get(base)
        if check is not None and not check(v):
            raise PolestarError(f"{name(key)} must be {type_word(base)}, got {v!r}")
    return dict(values)


def resolve(given: Mapping[str, Any], knobs: Optional[Mapping[str, Any]] = None,
            defaults: Optional[Mapping[str, int]] = None, family: Optional[str] = None,
            polestar: Optional[PolestarConfig] = None, name: Callable[[str], str] = str) -> Resolved:
    """The :class:`DecodeConfig` of the options ``given`` (DecodeConfig fields) and ``knobs`` (PolestarConfig
    fields) that the user set (absent: the default); ``defaults``: the model folder's generation defaults
    (``gen_length`` / ``block_length``); ``family``: the model family, whose Polestar values replace the
    defaults of the knobs not given; ``polestar``: a whole PolestarConfig instead of single knobs; ``name``:
    how messages name a field (the CLI: its flag). Raises :class:`PolestarError` (one line)."""
    from polestar_jax.models.family import polestar_config_for

    dec, knobs, defaults = dict(given), dict(knobs or {}), dict(defaults or {})
    unknown = sorted(set(dec) - set(DECODE_FIELDS)) + sorted(set(knobs) - set(POLESTAR_FIELDS))
    if unknown:
        raise PolestarError(f"unknown decoder setting(s) {', '.join(unknown)} (known: "
                            f"{', '.join(DECODE_FIELDS + POLESTAR_FIELDS)})")
    check_types(dec, DecodeConfig, name)
    check_types(knobs, PolestarConfig, name)
    decoder = str(dec.get("decoder", DecodeConfig.decoder))
    if polestar is not None and knobs:
        raise PolestarError("give either polestar=PolestarConfig(...) or single Polestar knobs, not both")
    if (knobs or (polestar is not None and polestar != PolestarConfig())) and decoder not in POLESTAR_DECODERS:
        names = ", ".join(name(k) for k in knobs) or "polestar"
        verb = "applies" if len(knobs) == 1 else "apply"
        raise PolestarError(f"{names} {verb} to decoder polestar only, or polestar_v (decoder is {decoder})")
    if dec.get("cache") is None:
        dec["cache"] = {"llada": "none", "polestar_v": "prefix"}.get(decoder, "dual")
    if decoder == "llada" or dec.get("factor") is not None:
        dec.setdefault("threshold", None)
    fixed = decoder == "llada" or ("threshold" in dec and dec["threshold"] is None and dec.get("factor") is None)
    if dec.get("steps") is not None and not fixed:
        raise PolestarError(f"{name('steps')} applies to the fixed schedule only (decoder llada, or fastdllm with "
                            f"{name('threshold')} none)")
    notes = []
    gen = dec.get("gen_length") or defaults.get("gen_length", 128)
    if dec.get("block_length") is None:
        block = defaults.get("block_length", 32)
        if gen % block:
            if gen > block:
                raise PolestarError(f"gen length {gen} is not a multiple of the block length {block} (give a "
                                    f"multiple of {block}, or {name('block_length')})")
            notes.append(f"block length {gen} (the gen length; this model's block length is {block}, and a "
                         f"model trained with one block length may answer wrongly with another)")
            block = gen
        dec["block_length"] = block
    dec["gen_length"] = gen
    dec["decoder"] = decoder
    if polestar is None:
        polestar = polestar_config_for(family, decoder, **knobs)
    return Resolved(DecodeConfig(**dec, polestar=polestar), tuple(notes))
