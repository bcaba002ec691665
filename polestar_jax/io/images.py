"""Images from users: opened, checked and turned into RGB; LLaDA-V prompts with ``<image>`` placeholders.

What a user may hand over as an image (:func:`open_image`): a path, a PIL image, raw bytes, or (the
server) a base64 ``data:`` URL (:func:`image_from_url`). Every way ends in one RGB PIL image or one
:class:`~polestar_jax.errors.PolestarError` line that names the image and says what is wrong with it:

* not an image, or a truncated file: Pillow cannot decode it;
* too large: more than :data:`MAX_PIXELS` pixels (checked from the header, before anything is decoded) or,
  for a ``data:`` URL, more than :data:`MAX_URL_BYTES` bytes;
* a mode without an 8-bit RGB reading: 16/32-bit integer and float images (``I``, ``I;16``, ``F``), which
  ``Image.convert("RGB")`` (what the official loader calls) clips to white and black. Every other mode is
  converted as the official loader converts it (``Image.convert("RGB")``): ``L``/``1`` grey to grey,
  ``P`` through its palette, ``RGBA``/``LA``/``PA`` with the alpha channel dropped (not composited),
  ``CMYK``/``YCbCr`` by Pillow's formulas (``docs/differences.md#d43``).

The prompt (:func:`image_prompt_ids`): LLaDA-V's loader asks with a system message and puts ``<image>\\n``
before a question that has no ``<image>`` of its own; the chat template renders it; the text is cut at each
``<image>`` and the pieces encoded without special tokens (the template holds the BOS), with
:data:`IMAGE_TOKEN_INDEX` between them (``docs/differences.md#d42``).
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import re
import urllib.parse
import urllib.request
from typing import Any, Optional, Sequence, Union

from polestar_jax.errors import PolestarError

#: The placeholder id of one image in prompt ids (LLaVA's ``IMAGE_TOKEN_INDEX``; the same value as
#: :data:`polestar_jax.models.llada_v.IMAGE_TOKEN_INDEX`, which this layer cannot import).
IMAGE_TOKEN_INDEX = -200
#: The placeholder of one image in prompt text.
IMAGE_TOKEN = "<image>"
#: The system message of LLaDA-V's official loader (``SYSTEM_PROMPT``).
SYSTEM_PROMPT = ("You are a helpful language and vision assistant. You are able to understand the visual content "
                 "that the user provides, and assist the user with a variety of tasks using natural language.")
#: The most pixels an image may have (width x height; 64 MP, e.g. 8192 x 8192): beyond, an error before decoding.
MAX_PIXELS = 8192 * 8192
#: The most bytes a ``data:`` URL may carry (its base64 text).
MAX_URL_BYTES = 32 * 2**20
#: Modes with no 8-bit RGB reading (``Image.convert("RGB")`` clips them): refused.
REFUSED_MODES = ("I", "F", "I;16", "I;16L", "I;16B", "I;16N")

ImageSource = Union[str, os.PathLike, bytes, Any]  # a path, encoded bytes or a PIL image
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


def to_rgb(image, name: str = "the image"):
    """An RGB copy of the PIL ``image`` (itself if RGB already) or a one-line :class:`PolestarError` for a
    mode without an 8-bit RGB reading or too many pixels (module docstring)."""
    w, h = image.size
    if w * h > MAX_PIXELS:
        raise PolestarError(f"{name}: {w}x{h} pixels is too large (at most {MAX_PIXELS:,} pixels)")
    if w < 1 or h < 1:
        raise PolestarError(f"{name}: an image of {w}x{h} pixels is empty")
    if image.mode in REFUSED_MODES:
        raise PolestarError(f"{name}: mode {image.mode} ({'float' if image.mode == 'F' else '16/32-bit'} pixels) "
                            "has no 8-bit RGB reading; save it as 8-bit RGB or greyscale")
    return image if image.mode == "RGB" else image.convert("RGB")


def _decode(fp, name: str):
    """The decoded RGB image of the open file ``fp``: the size checked from the header first."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(fp) as im:
            w, h = im.size
            if w * h > MAX_PIXELS:  # before decoding a single pixel
                raise PolestarError(f"{name}: {w}x{h} pixels is too large (at most {MAX_PIXELS:,} pixels)")
            im.load()
            return to_rgb(im, name)
    except PolestarError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, UnidentifiedImageError):
            why = "Pillow knows no image format of these bytes"
        if "truncated" in why:
            raise PolestarError(f"{name}: the image file is truncated ({why})") from None
        raise PolestarError(f"{name}: not a readable image ({why})") from None


def open_image(source: ImageSource, name: Optional[str] = None):
    """The RGB PIL image of ``source`` (a path, the encoded bytes of an image file, or a PIL image) or a
    one-line :class:`PolestarError` naming it (``name``, default the path or "the image")."""
    from PIL import Image

    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        name = name or path
        if not os.path.isfile(path):
            raise PolestarError(f"{name}: no such image file")
        with open(path, "rb") as f:
            return _decode(f, name)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(io.BytesIO(bytes(source)), name or "the image")
    if isinstance(source, Image.Image):
        return to_rgb(source, name or "the image")
    raise PolestarError(f"{name or 'the image'}: expected a path, image bytes or a PIL image, "
                        f"got {type(source).__name__}")


def image_from_url(url: str, name: str = "image_url", local_dir: Optional[str] = None):
    """The RGB PIL image of an OpenAI ``image_url``: a base64 ``data:`` URL, or, when ``local_dir`` is given,
    a ``file://`` URL (or a plain path) of a file under that folder. Anything else (``http(s)://``: this
    server fetches nothing) is a one-line :class:`PolestarError`."""
    if not isinstance(url, str) or not url:
        raise PolestarError(f"{name}: expected a URL string")
    m = _DATA_URL.match(url)
    if m:
        if not m.group("b64"):
            raise PolestarError(f"{name}: a data: URL must be base64-encoded (data:image/png;base64,...)")
        body = url[m.end():]
        if len(body) > MAX_URL_BYTES:
            raise PolestarError(f"{name}: the data: URL has {len(body):,} bytes (at most {MAX_URL_BYTES:,})")
        try:
            raw = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise PolestarError(f"{name}: the data: URL is not valid base64") from None
        return open_image(raw, name)
    if local_dir is None:
        raise PolestarError(f"{name}: only base64 data: URLs are accepted (data:image/png;base64,...); this "
                            "server fetches nothing and reads local files only with --allow-local-images DIR")
    if url.startswith("file:"):  # RFC 8089: file:///abs, file://localhost/abs; percent-escapes decoded
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise PolestarError(f"{name}: a file:// URL names this machine's files only (host {parts.netloc!r})")
        path = urllib.request.url2pathname(parts.path)
    elif "://" in url:
        raise PolestarError(f"{name}: only data: URLs and file:// paths under the allowed folder are accepted")
    else:
        path = url
    root = os.path.realpath(local_dir)
    real = os.path.realpath(os.path.join(root, path))  # a relative path is read under the folder
    if os.path.commonpath([root, real]) != root:
        raise PolestarError(f"{name}: {path} is outside the folder images may be read from")
    return open_image(real, name)


def question_with_images(text: str, n_images: int) -> str:
    """LLaDA-V's question: ``text`` as it is when it holds ``n_images`` ``<image>`` placeholders already, else
    one ``<image>\\n`` per image before it; a one-line error when the count differs."""
    have = text.count(IMAGE_TOKEN)
    if have == 0:
        return IMAGE_TOKEN + "\n" + (IMAGE_TOKEN + "\n") * (n_images - 1) + text if n_images else text
    if have != n_images:
        raise PolestarError(f"the prompt has {have} {IMAGE_TOKEN} placeholder(s) and {n_images} image(s)")
    return text


def split_image_ids(tokenizer, text: str) -> list[int]:
    """Rendered prompt ``text`` as ids: the pieces between ``<image>`` encoded without special tokens,
    :data:`IMAGE_TOKEN_INDEX` in place of each ``<image>``."""
    out: list[int] = []
    for k, piece in enumerate(text.split(IMAGE_TOKEN)):
        if k:
            out.append(IMAGE_TOKEN_INDEX)
        if piece:
            out.extend(tokenizer.encode(piece))
    return out


def with_system(messages: Sequence[dict], system: Optional[str] = SYSTEM_PROMPT) -> list[dict]:
    """``messages`` with LLaDA-V's system message first unless they have one (``system`` None: as given)."""
    messages = [dict(m) for m in messages]
    if system is not None and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def image_prompt_ids(tokenizer, text: str, n_images: int, chat: bool = True,
                     system: Optional[str] = SYSTEM_PROMPT) -> list[int]:
    """The prompt ids of a LLaDA-V question ``text`` about ``n_images`` images (module docstring): the
    official loader's system message and user turn through the chat template (``chat``; else the question
    itself), :data:`IMAGE_TOKEN_INDEX` where each image goes."""
    question = question_with_images(text, n_images)
    if chat and tokenizer.chat_template:
        question = tokenizer.apply_chat_template(with_system([{"role": "user", "content": question}], system))
    return split_image_ids(tokenizer, question)
