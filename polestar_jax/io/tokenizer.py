"""Tokenizers for LLaDA and Dream model folders, read offline from the Hugging Face layout.

A model folder holds ``tokenizer.json`` (a serialized Hugging Face ``tokenizers`` tokenizer) and usually
``tokenizer_config.json`` (as written by HF ``transformers``: ``chat_template``, ``bos_token``,
``eos_token``, ``mask_token``, ``added_tokens_decoder`` ...; a special token is either a string or a dict with
a ``"content"`` key). A Qwen2-style folder (Dream-7B: ``tokenizer_class`` ``DreamTokenizer`` /
``Qwen2Tokenizer``, or ``model_type`` Dream / qwen2) may instead hold ``vocab.json`` + ``merges.txt``: the
byte-level BPE is then assembled with the ``tokenizers`` library in Qwen2's form (:func:`qwen2_pipeline`: NFC,
Qwen2's split regex, byte-level symbols, ranks from ``merges.txt``) and the added tokens of
``tokenizer_config.json`` (``added_tokens_decoder``) or ``added_tokens.json`` at their ids.
:func:`load_tokenizer` reads all of it and returns a :class:`Tokenizer` that encodes, decodes and renders the
chat template the way ``transformers`` does (a sandboxed Jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``), without importing ``transformers`` or touching the network.

:func:`bundled_model_dir` points at the default model shipped with the package, ``tiny_tasks``: a tiny
LLaDA trained on the synthetic tasks of ``bench/tasks`` (see ``polestar_jax/assets/tiny_tasks/README.md``),
which lets the command line run without ``--model``. :func:`asset_model_dir` reaches the other bundled
folders (``tiny_random``: a random LLaDA with the same tokenizer; ``tiny_dream``: a random Dream model with a
small Qwen2-style BPE tokenizer).
"""
from __future__ import annotations

import functools
import importlib.resources
import json
import os
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from polestar_jax.config import MASK_TOKENS
from polestar_jax.errors import PolestarError

__all__ = ["Tokenizer", "load_tokenizer", "bundled_model_dir", "asset_model_dir", "BUNDLED_MODEL_NAME",
           "END_OF_TURN_TOKENS", "QWEN2_SPLIT_PATTERN", "qwen2_pipeline"]

#: Name of the folder under ``polestar_jax/assets`` that holds the default model.
BUNDLED_MODEL_NAME = "tiny_tasks"

# Special-token fields of tokenizer_config.json passed to the chat template (as transformers does).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
#: The chat models' end-of-turn tokens: LLaDA's ``<|eot_id|>``, Qwen2 / Dream's ChatML ``<|im_end|>``, the Ling
#: chat format's ``<|role_end|>`` (LLaDA-MoE's tokenizer and template).
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|role_end|>")
#: Qwen2's pre-tokenizer split (Qwen2Tokenizer, DreamTokenizer): English contractions, a letter run with at
#: most one leading non-letter, single digits, punctuation runs with their newlines, newline runs, spaces.
QWEN2_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer_config.json classes (and, without one, config.json model types) whose vocab.json + merges.txt
# are Qwen2's byte-level BPE
_QWEN2_CLASSES = ("DreamTokenizer", "Qwen2Tokenizer", "Qwen2TokenizerFast")
_QWEN2_MODEL_TYPES = ("Dream", "qwen2")


def asset_model_dir(name: str) -> str:
    """Path of the model folder ``polestar_jax/assets/<name>`` bundled with the package."""
    return str(importlib.resources.files("polestar_jax") / "assets" / name)


def bundled_model_dir() -> str:
    """Path of the default model folder bundled with the package (``assets/tiny_tasks``)."""
    return asset_model_dir(BUNDLED_MODEL_NAME)


def qwen2_pipeline(tok: _HFTokenizer) -> _HFTokenizer:
    """Gives the BPE tokenizer ``tok`` Qwen2's text pipeline (in place; returns it): NFC normalisation,
    :data:`QWEN2_SPLIT_PATTERN` then GPT-2's byte-to-symbol map as the pre-tokenizer (no prefix space), the
    byte-level decoder (invalid UTF-8 becomes U+FFFD, no space clean-up) and no added tokens on encode."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _token_content(value: Any) -> Optional[str]:
    """A special token from ``tokenizer_config.json``: a string, or a dict with a ``"content"`` key."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PolestarError(f"{path}: cannot read JSON ({type(e).__name__}: {e})".replace("\n", " ")) from None


def _raise_exception(message: str) -> None:
    """``raise_exception`` as seen by chat templates (templates call it to reject a conversation)."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple[str, str]] = None, sort_keys: bool = False) -> str:
    """The ``tojson`` filter of transformers (no HTML escaping, unlike Jinja2's built-in one)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile_template(template: str) -> jinja2.Template:
    """``template`` compiled in the Jinja2 environment transformers renders chat templates in."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


class Tokenizer:
    """A Hugging Face ``tokenizers`` tokenizer plus what ``tokenizer_config.json`` adds to it.

    Args:
        hf_tokenizer: the ``tokenizers.Tokenizer`` read from ``tokenizer.json``.
        tokenizer_config: the parsed ``tokenizer_config.json`` (``{}`` when the folder has none).
        model_config: the parsed ``config.json`` (``{}`` when absent); a fallback for the ids of the
            EOS / pad / mask tokens.
        chat_template: the Jinja2 chat template, or ``None`` when the model has none (kept as the attribute
            of that name).
        source: the model folder, used in error messages.
    """

    def __init__(self, hf_tokenizer: _HFTokenizer, tokenizer_config: Optional[Mapping[str, Any]] = None,
                 model_config: Optional[Mapping[str, Any]] = None, chat_template: Optional[str] = None,
                 source: str = "<memory>") -> None:
        self._tok = hf_tokenizer
        self._tok_config: dict[str, Any] = dict(tokenizer_config or {})
        self._model_config: dict[str, Any] = dict(model_config or {})
        self.chat_template = chat_template
        self.source = source
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            content = _token_content(self._tok_config.get(key))
            if content is not None:
                self.special_tokens[key] = content

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added (special) tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of ``token`` in the vocabulary, or ``None``."""
        return self._tok.token_to_id(token)

    def _special_id(self, key: str, config_key: Optional[str] = None) -> Optional[int]:
        """Id of special token ``key`` (e.g. ``"eos_token"``) named by tokenizer_config.json, else the
        ``config_key`` field of config.json."""
        token = self.special_tokens.get(key)
        if token is not None:
            tid = self._tok.token_to_id(token)
            if tid is not None:
                return tid
        value = self._model_config.get(config_key) if config_key else None
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._special_id("bos_token", "bos_token_id")

    @property
    def eos_token_id(self) -> Optional[int]:
        """Id of the end-of-sequence token (tokenizer_config.json ``eos_token``, else config.json)."""
        return self._special_id("eos_token", "eos_token_id")

    @property
    def pad_token_id(self) -> Optional[int]:
        return self._special_id("pad_token", "pad_token_id")

    @property
    def mask_token_id(self) -> Optional[int]:
        """Id of the diffusion mask token: tokenizer_config.json ``mask_token``, else the first of
        :data:`~polestar_jax.config.MASK_TOKENS` in the vocabulary (LLaDA-8B's ``<|mdm_mask|>``, LLaDA-MoE's
        ``<|mask|>``), else config.json ``mask_token_id``."""
        token = self.special_tokens.get("mask_token")
        if token is not None and self._tok.token_to_id(token) is not None:
            return self._tok.token_to_id(token)
        tid = next((i for i in map(self._tok.token_to_id, MASK_TOKENS) if i is not None), None)
        if tid is not None:
            return tid
        value = self._model_config.get("mask_token_id")
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        """Ids of the chat end-of-turn tokens in the vocabulary (:data:`END_OF_TURN_TOKENS`): a response
        ends there as at EOS."""
        mask = self.mask_token_id  # (never a stop: a block still holding masks is undecided)
        return frozenset(i for i in map(self._tok.token_to_id, END_OF_TURN_TOKENS) if i is not None and i != mask)

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|eot_id|>``) become single ids;
        ``add_special_tokens`` applies the tokenizer's post-processor (e.g. a BOS), if it has one."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 come out as U+FFFD."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat template
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Renders ``messages`` (``[{"role": "user", "content": "..."}, ...]``) with the chat template,
        as ``transformers`` does with ``tokenize=False``. Extra keyword arguments become template
        variables. Raises :class:`PolestarError` if there is no template or rendering fails."""
        if not self.chat_template:
            raise PolestarError(f"{self.source}: the tokenizer has no chat template")
        try:
            compiled = _compile_template(self.chat_template)
        except jinja2.exceptions.TemplateError as e:
            raise PolestarError(f"{self.source}: invalid chat template ({e})".replace("\n", " ")) from None
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update(kwargs)
        variables["messages"] = [dict(m) for m in messages]
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return compiled.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise PolestarError(f"{self.source}: chat template failed: {e}".replace("\n", " ")) from None

    def chat_prompt_ids(self, user_text: str) -> list[int]:
        """Prompt ids for a single user turn: the chat template with a generation prompt, encoded without
        extra special tokens; the raw text encoded when the model has no chat template."""
        if not self.chat_template:
            return self.encode(user_text)
        return self.encode(self.apply_chat_template([{"role": "user", "content": user_text}]))

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
                f"eos_token_id={self.eos_token_id}, mask_token_id={self.mask_token_id})")


def _find_chat_template(model_dir: str, tok_config: Mapping[str, Any]) -> Optional[str]:
    """The chat template: ``chat_template.jinja`` if present (newer transformers), else the
    ``chat_template`` of tokenizer_config.json (a string, or a list of ``{"name", "template"}``)."""
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        try:
            with open(jinja_path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise PolestarError(f"{jinja_path}: cannot read ({e})") from None
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


def _added_tokens(model_dir: str, tok_config: Mapping[str, Any]) -> list[tuple[int, AddedToken]]:
    """``(id, token)`` of the added tokens of a vocab.json + merges.txt folder, in id order:
    ``added_tokens_decoder`` of tokenizer_config.json, then ``added_tokens.json`` (content -> id) for the
    ones it lacks (special if tokenizer_config.json names them as special tokens)."""
    named = {_token_content(tok_config.get(k)) for k in _SPECIAL_TOKEN_KEYS}
    named |= {_token_content(t) for t in tok_config.get("additional_special_tokens") or ()}
    out: dict[int, AddedToken] = {}
    decoder = tok_config.get("added_tokens_decoder") or {}
    for key, entry in decoder.items() if isinstance(decoder, Mapping) else ():
        content = _token_content(entry)
        if content is None or not isinstance(entry, Mapping) or not str(key).isdigit():
            raise PolestarError(f"{model_dir}/tokenizer_config.json: bad added_tokens_decoder entry {key!r}")
        special = bool(entry.get("special", False))
        flags = {k: bool(entry.get(k, False)) for k in ("single_word", "lstrip", "rstrip")}
        out[int(key)] = AddedToken(content, special=special, normalized=bool(entry.get("normalized", not special)),
                                   **flags)
    path = os.path.join(model_dir, "added_tokens.json")
    extra = _read_json(path) if os.path.isfile(path) else {}
    if not isinstance(extra, dict):
        raise PolestarError(f"{path}: expected a JSON object (token -> id)")
    have = {t.content for t in out.values()}
    for content, tid in extra.items():
        if content not in have and isinstance(tid, int) and tid not in out:
            special = content in named
            out[tid] = AddedToken(content, special=special, normalized=not special)
    return sorted(out.items())


def _qwen2_from_vocab_merges(model_dir: str, tok_config: Mapping[str, Any],
                             model_config: Mapping[str, Any]) -> _HFTokenizer:
    """The Qwen2 byte-level BPE of ``vocab.json`` + ``merges.txt`` (:func:`qwen2_pipeline`) with the folder's
    added tokens at their ids; a one-line :class:`PolestarError` for another tokenizer class or an added
    token whose id the vocabulary cannot give."""
    cls = tok_config.get("tokenizer_class")
    if not (cls in _QWEN2_CLASSES or (cls is None and model_config.get("model_type") in _QWEN2_MODEL_TYPES)):
        raise PolestarError(f"{model_dir}: vocab.json + merges.txt are read as Qwen2's byte-level BPE only "
                            f"(tokenizer_class {', '.join(_QWEN2_CLASSES)}), not {cls or 'an unnamed class'}; "
                            "save the tokenizer with tokenizer.json")
    vocab, merges = os.path.join(model_dir, "vocab.json"), os.path.join(model_dir, "merges.txt")
    try:
        bpe = models.BPE.from_file(vocab, merges)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PolestarError(f"{model_dir}: cannot read vocab.json + merges.txt ({msg})") from None
    tok = qwen2_pipeline(_HFTokenizer(bpe))
    for tid, token in _added_tokens(model_dir, tok_config):
        (tok.add_special_tokens if token.special else tok.add_tokens)([token])
        got = tok.token_to_id(token.content)
        if got != tid:
            raise PolestarError(f"{model_dir}: added token {token.content!r} has id {tid} in the tokenizer files "
                                f"but comes out as {got} after the {tok.get_vocab_size(False)}-token vocabulary")
    return tok


def _read_hf_tokenizer(tok_path: str) -> _HFTokenizer:
    try:
        return _HFTokenizer.from_file(tok_path)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PolestarError(f"{tok_path}: cannot load tokenizer ({msg})") from None


def load_tokenizer(model_dir: str | os.PathLike[str]) -> Tokenizer:
    """Loads the tokenizer of the HF model folder ``model_dir`` (offline).

    Reads ``tokenizer.json`` or, without it, a Qwen2-style ``vocab.json`` + ``merges.txt`` (module
    docstring), and ``tokenizer_config.json`` and ``config.json`` (optional). Raises :class:`PolestarError`
    with a one-line message when the folder or the tokenizer files are missing or unreadable.
    """
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise PolestarError(f"model folder not found: {model_dir}")
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    tok_config = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    if not isinstance(tok_config, dict):
        raise PolestarError(f"{cfg_path}: expected a JSON object")
    model_cfg_path = os.path.join(model_dir, "config.json")
    model_config = _read_json(model_cfg_path) if os.path.isfile(model_cfg_path) else {}
    if not isinstance(model_config, dict):
        model_config = {}
    tok_path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(tok_path):
        hf_tok = _read_hf_tokenizer(tok_path)
    elif all(os.path.isfile(os.path.join(model_dir, f)) for f in ("vocab.json", "merges.txt")):
        hf_tok = _qwen2_from_vocab_merges(model_dir, tok_config, model_config)
    else:
        raise PolestarError(f"no tokenizer.json (or vocab.json + merges.txt) in model folder {model_dir}")
    return Tokenizer(hf_tok, tok_config, model_config, _find_chat_template(model_dir, tok_config),
                     source=model_dir)
