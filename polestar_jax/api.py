"""Text in, text out: the Python API over the decoding engine.

::

    from polestar_jax.api import load

    model = load()                                  # the bundled tiny_tasks model (or load("/models/llada8b-jax"))
    out = model.generate(["reverse: ann,bob,cal,dan", "copy: eve,fay,gus"])
    for r in out:
        print(r.text, r.nfe, r.tpf, r.stats)        # stats: Polestar's refresh steps, early / suffix commits
    print(out.tps, out.compile_seconds)

    vlm = load("/models/llada-v")                  # a LLaDA-V folder: one image (a path or a PIL image) per prompt
    out = vlm.generate(["What is in the picture?", "Say hi."], images=["cat.png", None])

:func:`load` reads a model folder (HF or converted; the bundled ``tiny_tasks`` model when none is given) with
its tokenizer, chat template and generation defaults, and turns on the persistent compilation cache and the
executable store the command lines use (:func:`use_compile_cache`; ``POLESTAR_JAX_CACHE=off`` or
``load(..., compile_cache=False)`` opts out), so a rerun loads its programs instead of compiling them.
:meth:`Model.generate` decodes a list of strings as one batch (or in batches of ``batch_size``) with the
same engine as ``python -m polestar_jax.generate``; the decoder knobs are the fields of
:class:`~polestar_jax.config.DecodeConfig` and :class:`~polestar_jax.config.PolestarConfig` as keyword
arguments, with the same defaults as the command line (decoder ``polestar``; gen / block length from the
folder's ``generation_config.json``, else 128 / 32; cache ``none`` for ``llada``, else ``dual``).

Prompt ``i`` of a call is row ``i`` of the job: its randomness (sampling noise, Polestar's k-means draws) comes
from ``(seed, i)`` only (:func:`polestar_jax.decode.state.row_key_data`), so it decodes the same whatever the batch
size, exactly as the ``i``-th prompt of ``generate --prompts-file``.

Accounting, as ``bench.run`` counts it (and the paper): ``non_eos_tokens`` = generated ids that are not the
model's EOS / pad id; ``tpf`` = non-EOS tokens / forwards (NFE); ``tps`` = non-EOS tokens / decode seconds
(compile time apart, in ``compile_seconds``). The response text is cut at the first end-of-text id (EOS, pad
or the chat end-of-turn token, ``<|eot_id|>`` / ``<|im_end|>``) and decoded without special tokens.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Iterator, Mapping, Optional, Sequence, Union


from polestar_jax.config import DecodeConfig, ModelConfig, PolestarConfig
from polestar_jax.errors import PolestarError
from polestar_jax.models import quant
from polestar_jax.resolve import DECODE_FIELDS, POLESTAR_FIELDS, resolve, type_word  # noqa: F401 (re-exported)

__all__ = ["Model", "Generation", "Generations", "load", "use_compile_cache", "decode_config", "DECODE_FIELDS",
           "POLESTAR_FIELDS", "EOT_TOKEN"]

#: The chat models' end-of-turn token: a stop id like EOS (the response ends there), but counted by TPF.
EOT_TOKEN = "<|eot_id|>"
def decode_config(defaults: Optional[Mapping[str, int]] = None, polestar: Optional[PolestarConfig] = None,
                  family: Optional[str] = None, **given: Any) -> DecodeConfig:
    """The :class:`DecodeConfig` for the given knobs, with the command line's defaults (the same config as
    ``python -m polestar_jax.generate`` with the matching flags would use: both resolve it with
    :func:`polestar_jax.resolve.resolve`).

    ``given``: :data:`DECODE_FIELDS` and :data:`POLESTAR_FIELDS` by name; a knob that is not passed takes its
    default, ``None`` means none (``threshold=None``: the fixed schedule). ``defaults``: the model folder's
    generation defaults (:func:`polestar_jax.io.checkpoint.generation_defaults`) for ``gen_length`` /
    ``block_length``. ``polestar``: a whole :class:`PolestarConfig` instead of single knobs. ``family``: the
    model family (``ModelConfig.family``), whose Polestar parameters (``Family.polestar_defaults``, e.g.
    Dream's) replace the defaults of the knobs not given. What the resolution changed (a block length cut
    to a short gen length) is reported with :func:`warnings.warn`.
    Raises :class:`PolestarError` (a one-line message) for unknown names, knobs that would have no effect
    and values the configs reject."""
    dec = {k: v for k, v in given.items() if k not in POLESTAR_FIELDS}
    knobs = {k: v for k, v in given.items() if k in POLESTAR_FIELDS}
    out = resolve(dec, knobs, defaults, family=family, polestar=polestar)
    for note in out.notes:
        warnings.warn(note, stacklevel=2)
    return out.decode


@dataclasses.dataclass
class Generation:
    """One decoded prompt.

    text            the response: generated ids up to the first end-of-text id, decoded without special tokens
    token_ids       the generated ids of the blocks decoded (all ``gen_length`` of them without early exit)
    response_ids    the ids of ``text``
    nfe             forwards (network function evaluations) of this row
    non_eos_tokens  generated ids that are not EOS / pad (TPF's numerator)
    tpf             non_eos_tokens / nfe
    tps             tokens/s of the job this row was decoded in
    finish_reason   "stop" (a stop token ended the response) or "length"
    blocks          blocks decoded (early exit: up to the first block holding a stop token)
    row             the row index in the job (its randomness comes from (seed, row))
    stats           decoder polestar: refresh_steps, early_commits, suffix_commits, windowed_passes; else {}
    prompt          the prompt text (None when decoded from ids)
    """

    text: str
    token_ids: list[int]
    response_ids: list[int]
    nfe: int
    non_eos_tokens: int
    tpf: float
    tps: float
    row: int
    stats: dict = dataclasses.field(default_factory=dict)
    prompt: Optional[str] = None
    finish_reason: str = "length"
    blocks: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Generations(Sequence[Generation]):
    """The rows of one :meth:`Model.generate` call, in prompt order, and the job's totals.

    seconds          decode-loop seconds of all batches (first dispatch to results on the host), compile apart
    compile_seconds  seconds spent compiling (0 when every executable was already compiled or cached)
    batches          batches the job would take in fixed batches (prompts / batch size, rounded up)
    """

    rows: list[Generation]
    decode: DecodeConfig
    seconds: float
    compile_seconds: float
    batches: int = 1

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __iter__(self) -> Iterator[Generation]:
        return iter(self.rows)

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.rows]

    @property
    def nfe(self) -> int:
        return sum(r.nfe for r in self.rows)

    @property
    def non_eos_tokens(self) -> int:
        return sum(r.non_eos_tokens for r in self.rows)

    @property
    def tpf(self) -> float:
        """Non-EOS tokens / forwards over the job."""
        return self.non_eos_tokens / max(1, self.nfe)

    @property
    def tps(self) -> float:
        """Non-EOS tokens / decode seconds over the job."""
        return self.non_eos_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"rows": [r.to_dict() for r in self.rows], "nfe": self.nfe, "non_eos_tokens": self.non_eos_tokens,
                "tpf": self.tpf, "tps": self.tps, "decode_seconds": self.seconds,
                "compile_seconds": self.compile_seconds, "batches": self.batches,
                "decoder": self.decode.decoder, "cache": self.decode.cache, "gen_length": self.decode.gen_length,
                "block_length": self.decode.block_length}


def use_compile_cache() -> Optional[str]:
    """What :func:`load` does with ``compile_cache=True`` (the default): the persistent compilation cache and
    the executable store in its ``executables/`` folder, as the command lines have them. A cache folder this
    process already gave JAX (``jax_compilation_cache_dir``, ``JAX_COMPILATION_CACHE_DIR``) is kept;
    otherwise the command lines' setting is made (:func:`~polestar_jax.engine.compile_cache.enable_compile_cache`:
    ``$POLESTAR_JAX_CACHE``, default ``~/.cache/polestar_jax/xla``). ``POLESTAR_JAX_CACHE=off`` turns nothing
    on. Returns the folder in use, or None."""
    import jax

    from polestar_jax.engine.compile_cache import cache_folder, enable_compile_cache

    if cache_folder() is None:
        return None
    return jax.config.jax_compilation_cache_dir or enable_compile_cache()


class Model:
    """A loaded model folder: parameters, tokenizer (with its chat template) and generation defaults.

    path:           the folder (HF or converted); None = the bundled ``tiny_tasks`` model
    dtype:          cast the weights (``"float32"``, ``"bfloat16"``; default: as stored)
    weights:        ``"float"`` (default) or ``"int8"``: every matmul weight stored as int8 with a scale per
                    output channel (:mod:`polestar_jax.models.quant`; about half the bytes of bfloat16)
    mesh:           shard over a device mesh: ``"data=2,model=4"`` or a ``jax.sharding.Mesh``; a string first
                    joins the multi-process runtime the environment describes
                    (:func:`polestar_jax.sharding.join_runtime`), so the mesh spans every process's devices
    compile_cache:  the persistent compilation cache and the executable store, as the command lines have them
                    (:func:`use_compile_cache`: a rerun of the same shapes loads its programs in a fraction of a
                    second instead of compiling them); a folder the process already gave JAX is kept.
                    ``compile_cache=False`` or ``POLESTAR_JAX_CACHE=off`` leaves JAX's settings untouched
    log:            called with a line before and after each compile (:class:`polestar_jax.engine.engine.Engine`)
    config:         the folder's :class:`ModelConfig` when the caller has read it already (``generate`` resolves
                    its flags against it before the weights load): ``config.json`` is then not read again

    ``model.engine`` is the :class:`~polestar_jax.engine.engine.Engine` every call decodes on (it keeps the compiled
    programs; ``model.engine.clear()`` drops them).
    """

    def __init__(self, path: Optional[str] = None, dtype: Optional[str] = None, mesh: Any = None,
                 compile_cache: bool = True, log: Optional[Any] = None, config: Optional[ModelConfig] = None,
                 weights: str = "float"):
        from polestar_jax import cli
        from polestar_jax.io.tokenizer import bundled_model_dir

        if path is not None:
            cli.need_folder(str(path))
        self.path = str(path) if path is not None else bundled_model_dir()
        self.compile_cache_dir = use_compile_cache() if compile_cache else None
        from polestar_jax import sharding
        from polestar_jax.io.checkpoint import generation_defaults, load_model
        from polestar_jax.io.tokenizer import load_tokenizer

        self.defaults = generation_defaults(self.path)
        if isinstance(mesh, str):  # join a multi-process runtime first (environment / cluster), if any
            sharding.join_runtime()
            mesh = sharding.mesh_or_none(mesh)
        self.mesh = mesh
        self.config: ModelConfig
        # with a mesh, each array is built from its shards (a process of a multi-process mesh reads its own)
        more = {} if config is None else {"config": config}  # (a config already read: not read again)
        quant.check_mode(weights)
        self.config, self.params = load_model(self.path, dtype=dtype, shardings=mesh, **more,
                                              transform=lambda p: quant.quantize_params(p, weights))
        self.dtype, self.weights = dtype, weights
        self.tokenizer = load_tokenizer(self.path)
        from polestar_jax.engine.engine import Engine

        self.engine = Engine(self.params, self.config, self.tokenizer, mesh=mesh, log=log)
        self.params = self.engine.params
        #: ids that end a response (EOS, pad, the chat end-of-turn token: <|eot_id|>, <|im_end|>)
        self.stop_ids = self.engine.stop_ids
        #: ids TPF does not count (EOS, pad), as bench.run and the paper
        self.eos_ids = self.engine.eos_ids

    def __repr__(self) -> str:
        return f"Model({self.path!r}, layers={self.config.n_layers}, d_model={self.config.d_model})"

    # ------------------------------------------------------------------------------------------- configs
    def decode_config(self, polestar: Optional[PolestarConfig] = None, **knobs: Any) -> DecodeConfig:
        """The :class:`DecodeConfig` :meth:`generate` uses for these knobs (see :func:`decode_config`)."""
        return decode_config(self.defaults, polestar=polestar, family=self.config.family, **knobs)

    @property
    def takes_images(self) -> bool:
        """Whether the model reads images (a LLaDA-V folder)."""
        from polestar_jax.engine.images import has_vision

        return has_vision(self.config)

    def image_prompts(self, texts: Sequence[str], images: Optional[Sequence[Any]] = None,
                      chat: bool = True) -> tuple[list[list[int]], Optional[list]]:
        """The prompt ids of ``texts`` and, for a model that takes images, each prompt's image rows.

        ``images``: one entry per prompt: None (text only), an image (a path, a PIL image or the bytes of an
        image file) or a list of images. A LLaDA-V prompt is its official rendering
        (:func:`polestar_jax.io.images.image_prompt_ids`: the system message, ``<image>`` before the question
        unless it has its own) with the images' rows in place (:mod:`polestar_jax.engine.images`); the second
        value is then a list of rows [R, D] or None per prompt. Other models: :meth:`prompt_ids`, and None.
        A bad image is a one-line :class:`PolestarError` naming the prompt."""
        from polestar_jax.io import images as io_images

        if images is not None and len(images) != len(texts):
            raise PolestarError(f"images has {len(images)} entries for {len(texts)} prompts (None for a text-only one)")
        if not self.takes_images:
            if images is not None and any(im is not None for im in images):
                raise PolestarError(f"{self.path}: this {self.config.family} model takes no images (LLaDA-V does)")
            return [self.prompt_ids(t, chat) for t in texts], None
        from polestar_jax.engine.images import prompt_with_images

        ids, rows = [], []
        for i, text in enumerate(texts):
            given = [] if images is None or images[i] is None else (
                list(images[i]) if isinstance(images[i], (list, tuple)) else [images[i]])
            pil = [io_images.open_image(im, None if isinstance(im, (str, os.PathLike)) else f"image {k} of prompt {i}")
                   for k, im in enumerate(given)]
            p, r = prompt_with_images(self.params, self.config,
                                      io_images.image_prompt_ids(self.tokenizer, text, len(pil), chat), pil)
            ids.append(p)
            rows.append(r)
        return ids, rows

    def prompt_ids(self, text: str, chat: bool = True) -> list[int]:
        """Prompt ids of ``text``: the chat template's rendering of one user turn (``chat=True``, as
        ``generate`` does: for a LLaDA-V model with its system message, as :meth:`image_prompts` renders a
        text-only prompt), or the text itself (``chat=False``, ``--no-chat``)."""
        if not isinstance(text, str):
            raise PolestarError(f"a prompt must be a string, got {type(text).__name__}")
        if self.takes_images:
            from polestar_jax.io import images as io_images

            return io_images.image_prompt_ids(self.tokenizer, text, 0, chat)
        return self.tokenizer.chat_prompt_ids(text) if chat else self.tokenizer.encode(text)

    # ------------------------------------------------------------------------------------------- decoding
    def generate(self, prompts: Union[str, Sequence[str]], *, seed: int = 0, chat: bool = True,
                 batch_size: Optional[int] = None, polestar: Optional[PolestarConfig] = None,
                 images: Optional[Sequence[Any]] = None, **knobs: Any) -> Generations:
        """Decodes ``prompts`` (a string or a list of strings) and returns their :class:`Generations`.

        seed:        the job seed; prompt i's randomness comes from (seed, i)
        chat:        render each prompt with the chat template (default) or encode it as it is
        batch_size:  decode in batches of this many rows (the last one padded) at one prompt slot; default:
                     all prompts in one batch
        images:      a LLaDA-V model: one entry per prompt, None (text only), a path, a PIL image, image
                     bytes or a list of them (see :meth:`image_prompts`); a single prompt may take one image
        knobs:       decoder settings by field name (``decoder="fastdllm"``, ``threshold=0.8``,
                     ``gen_length=64``, ``top_k=2``, ...; see :func:`decode_config`)
        """
        single = isinstance(prompts, str)
        texts = [prompts] if single else list(prompts)
        if not texts:
            raise PolestarError("no prompt given")
        for i, p in enumerate(texts):
            if not isinstance(p, str) or not p.strip():
                raise PolestarError(f"prompt {i} is empty" if isinstance(p, str) else
                                    f"prompt {i} is not a string ({type(p).__name__})")
        dcfg = self.decode_config(polestar=polestar, **knobs)
        if single and images is not None and not isinstance(images, (list, tuple)):
            images = [images]
        ids, rows = self.image_prompts(texts, images, chat)
        return self.generate_ids(ids, dcfg, seed=seed, batch_size=batch_size, prompts=texts, images=rows)

    def precompile(self, shapes: Sequence[tuple[int, int]], *, running: bool = False,
                   polestar: Optional[PolestarConfig] = None, **knobs: Any) -> list:
        """Compiles the programs :meth:`generate` would use for these ``(batch, prompt_slot)`` shapes and
        knobs now, and returns their :class:`~polestar_jax.engine.compile_cache.CompileRecord` (none for a shape already
        compiled). A fixed batch of n prompts runs at :func:`~polestar_jax.engine.engine.batch_bucket` ``(n)``
        rows and prompt slot ``ceil(longest / 16) * 16``; ``running=True`` compiles a continuous job's
        programs (``batch_size`` smaller than the prompts) instead. With the compile cache on (:func:`load`'s
        default) later processes load them from the persistent cache."""
        return self.engine.precompile(self.decode_config(polestar=polestar, **knobs), shapes, running=running)

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], dcfg: DecodeConfig, *, seed: int = 0,
                     rows: Optional[Sequence[int]] = None, batch_size: Optional[int] = None,
                     prompt_slot: Optional[int] = None, prompts: Optional[Sequence[str]] = None,
                     images: Optional[Sequence[Any]] = None) -> Generations:
        """Decodes token-id prompts with ``dcfg`` as one continuous job on :attr:`engine` (a batch of
        ``batch_size`` rows, default all, kept full: a finished row's slot takes the next prompt).
        ``rows``: each prompt's row index in the job (default ``0..n-1``; its randomness comes from
        (seed, row)). ``prompt_slot``: the padded prompt length (default: the longest prompt rounded up to
        16). ``images``: per prompt, the image rows its local ids name (:meth:`image_prompts`) or None."""
        n = len(prompt_ids)
        if n == 0:
            raise PolestarError("no prompt given")
        job = self.engine.generate(prompt_ids, dcfg, seed=seed, rows=rows, batch_size=batch_size,
                                   prompt_slot=prompt_slot, images=images)
        out = [self._row(r, job.rows[i].index, prompts[i] if prompts else None) for i, r in enumerate(job.rows)]
        tokens = sum(g.non_eos_tokens for g in out)
        for g in out:
            g.tps = tokens / job.seconds if job.seconds > 0 else 0.0
        return Generations(rows=out, decode=dcfg, seconds=job.seconds, compile_seconds=job.compile_seconds,
                           batches=-(-n // job.batch_size))

    def _row(self, r, row: int, prompt: Optional[str]) -> Generation:
        c = self.engine.completion(r)
        return Generation(text=self.tokenizer.decode(c.response_ids), token_ids=[int(t) for t in r.tokens],
                          response_ids=c.response_ids, nfe=c.nfe, non_eos_tokens=c.non_eos_tokens, tpf=c.tpf,
                          tps=0.0, row=row, stats=c.stats, prompt=prompt, finish_reason=c.finish_reason,
                          blocks=len(r.block_nfe))


def load(path: Optional[str] = None, dtype: Optional[str] = None, mesh: Any = None,
         compile_cache: bool = True, log: Optional[Any] = None, weights: str = "float") -> Model:
    """Loads a model folder (None: the bundled ``tiny_tasks`` model); see :class:`Model`."""
    return Model(path, dtype=dtype, mesh=mesh, compile_cache=compile_cache, log=log, weights=weights)
