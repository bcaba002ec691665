"""Chat requests with images (LLaDA-V): OpenAI ``image_url`` content parts into prompt ids and image rows.

A message's ``content`` may be a list of parts: ``{"type": "text", "text": ...}`` and
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (``image_url`` may also be the
URL string). Each image part becomes ``<image>\\n`` where it stands in its message's text (the official
loader puts the image before the question: send the image part first to match it); the conversation gets
LLaDA-V's system message unless it has one; the chat template renders it; the images' rows are spliced in
(:func:`polestar_jax.io.images.image_prompt_ids`, :mod:`polestar_jax.engine.images`). Only base64 ``data:``
URLs are read, unless the server names a folder that ``file://`` URLs may read from
(``--allow-local-images DIR``); every bad image is a :class:`PolestarError` line (the app answers 400).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from polestar_jax.errors import PolestarError
from polestar_jax.io import images as io_images


def _url(part: dict, where: str) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise PolestarError(f"{where}: an image_url part needs image_url.url (a data: URL)")
    return url


def message_text(content: Any, where: str, local_dir: Optional[str]) -> tuple[str, list]:
    """A message's text with ``<image>\\n`` for each image part, and the RGB images of those parts."""
    if content is None or isinstance(content, str):
        return content or "", []
    text, images = [], []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text.append(str(part.get("text", "")))
        elif kind == "image_url":
            name = f"{where}.content[{k}].image_url"
            images.append(io_images.image_from_url(_url(part, name), name, local_dir))
            text.append(io_images.IMAGE_TOKEN + "\n")
        else:
            raise PolestarError(f"{where}.content[{k}]: unsupported content part type {kind!r} (text, image_url)")
    return "".join(text), images


def chat_prompt(model, messages: Sequence[Any], local_dir: Optional[str] = None,
                max_prompt_tokens: Optional[int] = None) -> tuple[list[int], Any]:
    """``(local ids, image rows [R, D] or None)`` of a chat conversation for a model that takes images
    (module docstring); a one-line :class:`PolestarError` for a bad part or image, or (``max_prompt_tokens``)
    for a prompt whose images alone would pass that many rows: counted from their sizes before any of them
    goes through the tower."""
    from polestar_jax.engine.images import prompt_with_images
    from polestar_jax.models.llada_v import n_image_rows

    rendered, images = [], []
    for i, m in enumerate(messages):
        if io_images.IMAGE_TOKEN in str(m.content or ""):
            raise PolestarError(f"messages[{i}]: the text may not contain {io_images.IMAGE_TOKEN}; send images "
                                "as image_url parts")
        text, found = message_text(m.content, f"messages[{i}]", local_dir)
        rendered.append({"role": m.role, "content": text})
        images.extend(found)
    if not any(m["content"].strip() for m in rendered):
        raise PolestarError("the conversation is empty")
    if max_prompt_tokens is not None and images:
        rows = sum(n_image_rows(im.size, model.config.vision) for im in images)
        if rows > max_prompt_tokens:
            raise PolestarError(f"the {len(images)} image(s) take {rows} prompt rows, more than this server's "
                                f"{max_prompt_tokens} prompt tokens")
    tok = model.tokenizer
    text = (tok.apply_chat_template(io_images.with_system(rendered)) if tok.chat_template else
            "\n".join(m["content"] for m in rendered))
    return prompt_with_images(model.params, model.config, io_images.split_image_ids(tok, text), images)
