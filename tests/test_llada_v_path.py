"""A user's path through LLaDA-V (issue #46 items 3, 4, 6): images from paths, PIL images, bytes and data URLs,
checked (bad ones are one line); the official prompt with ``<image>``; the project's decoders on image
rows in any batch, continuous or fixed, each row equal to its batch-1 result; ``model.generate(images=)``,
``generate --image``, the server's ``image_url`` parts, ``convert`` of a LLaDA-V folder, and ``--dry-run`` at
LLaDA-V's real shapes. The model is a tiny random LLaDA-V folder (``tests/vlm.py``) over the bundled
tokenizer; the images are the golden folder's (40x28 and 384x384: 1261 and 1485 image rows)."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from polestar_jax.errors import PolestarError
from polestar_jax.io import images as io_images

from vlm import GOLDEN, make_tiny_llada_v  # tests/vlm.py

SMALL, SQUARE = GOLDEN / "images" / "small40x28.png", GOLDEN / "images" / "sq384.png"
REAL = Path(__file__).parent / "data" / "llada_v_config.json"
GEN = dict(gen_length=16, block_length=8)


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


# ------------------------------------------------------------------------------------------ images in
@pytest.mark.parametrize("mode", ["L", "1", "P", "RGBA", "LA", "CMYK", "YCbCr"])
def test_modes_are_converted_as_the_official_loader_converts_them(mode):
    """Every 8-bit mode becomes RGB by ``Image.convert("RGB")`` (the official loader's call): alpha dropped,
    not composited; from a PIL image and from the bytes of a saved file alike."""
    base = Image.open(SMALL).convert(mode)
    got = io_images.open_image(base)
    assert got.mode == "RGB" and got.size == (40, 28)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(base.convert("RGB")))
    if mode in ("L", "P", "RGBA", "LA"):  # (PNG keeps these modes)
        np.testing.assert_array_equal(np.asarray(io_images.open_image(_png(base))), np.asarray(base.convert("RGB")))


@pytest.mark.parametrize("mode", ["I", "F", "I;16"])
def test_modes_without_an_8bit_reading_are_one_line(mode):
    with pytest.raises(PolestarError) as e:
        io_images.open_image(Image.new(mode, (8, 8)))
    assert f"mode {mode}" in str(e.value) and len(str(e.value).splitlines()) == 1


def test_bad_files_are_one_line(tmp_path, monkeypatch):
    raw = SQUARE.read_bytes()
    cases = {"notimage.png": (b"hello, not an image", "not a readable image"),
             "truncated.png": (raw[: len(raw) // 2], "truncated"),
             "empty.png": (b"", "not a readable image")}
    for name, (data, word) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(PolestarError) as e:
            io_images.open_image(tmp_path / name)
        msg = str(e.value)
        assert word in msg and name in msg and len(msg.splitlines()) == 1, msg
    with pytest.raises(PolestarError, match="no such image file"):
        io_images.open_image(tmp_path / "missing.png")
    monkeypatch.setattr(io_images, "MAX_PIXELS", 384 * 383)
    with pytest.raises(PolestarError, match="384x384 pixels is too large"):
        io_images.open_image(SQUARE)  # from the header, before decoding


def test_image_urls(tmp_path):
    raw = SMALL.read_bytes()
    want = np.asarray(Image.open(SMALL).convert("RGB"))
    np.testing.assert_array_equal(np.asarray(io_images.image_from_url(_data_url(raw))), want)
    bad = {"https://example.com/cat.png": "only base64 data: URLs",
           "data:image/png,rawbytes": "base64-encoded",
           "data:image/png;base64,@@@": "not valid base64",
           _data_url(b"GIF89a-not-really"): "not a readable image",
           f"file://{SMALL}": "only base64 data: URLs"}
    for url, word in bad.items():
        with pytest.raises(PolestarError) as e:
            io_images.image_from_url(url, "messages[0].content[1].image_url")
        assert word in str(e.value) and str(e.value).startswith("messages[0]") and len(str(e.value).splitlines()) == 1
    # --allow-local-images DIR: file:// URLs under DIR only
    np.testing.assert_array_equal(np.asarray(io_images.image_from_url(f"file://{SMALL}", local_dir=str(GOLDEN))), want)
    with pytest.raises(PolestarError, match="outside the folder"):
        io_images.image_from_url(f"file://{SMALL}", local_dir=str(tmp_path))
    # RFC 8089 forms: a relative path is read under DIR, file://localhost/abs, percent-escapes; no escape by ..
    (tmp_path / "a b").mkdir()
    (tmp_path / "a b" / "x.png").write_bytes(raw)
    for url in ("a b/x.png", f"file://localhost{tmp_path}/a%20b/x.png", f"file://{tmp_path}/a%20b/x.png"):
        np.testing.assert_array_equal(np.asarray(io_images.image_from_url(url, local_dir=str(tmp_path))), want)
    for url, word in (("../" + SMALL.name, "outside the folder"), ("file://otherhost/x.png", "this machine")):
        with pytest.raises(PolestarError, match=word):
            io_images.image_from_url(url, local_dir=str(tmp_path / "a b"))


def test_the_prompt_is_the_official_rendering_without_the_dropped_token(model):
    """System message, ``<image>\\n`` before the question, the chat template; the pieces between images are
    encoded without special tokens, so the token after ``<image>`` stays (the reference drops it, J5: D42)."""
    tok = model.tokenizer
    ids = io_images.image_prompt_ids(tok, "What is this?", 1)
    text = tok.apply_chat_template([{"role": "system", "content": io_images.SYSTEM_PROMPT},
                                    {"role": "user", "content": "<image>\nWhat is this?"}])
    before, after = text.split("<image>")
    assert ids == tok.encode(before) + [io_images.IMAGE_TOKEN_INDEX] + tok.encode(after)
    assert tok.decode(ids[ids.index(-200) + 1:ids.index(-200) + 2]) == "\n"
    from polestar_jax.models import llada_v

    assert io_images.IMAGE_TOKEN_INDEX == llada_v.IMAGE_TOKEN_INDEX
    assert io_images.image_prompt_ids(tok, "A <image> and a <image>?", 2).count(-200) == 2
    with pytest.raises(PolestarError, match="1 <image> placeholder"):
        io_images.image_prompt_ids(tok, "A <image>?", 2)


# ------------------------------------------------------------------------------------------ the model
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llada_v(tmp_path_factory.mktemp("tiny_llada_v") / "model")


@pytest.fixture(scope="module")
def model(folder):
    from polestar_jax.api import load

    return load(str(folder), compile_cache=False)


def _tokens(gens) -> list:
    return [list(g.token_ids) for g in gens]


def test_images_of_different_sizes_batched_give_each_row_its_alone_tokens(model):
    """Two rows with images of different sizes (1261 and 1485 image rows) and a text-only row: in one fixed
    batch, and in a running batch of one slot (continuous batching: each prompt decoded alone, the next
    taking the freed slot at a block boundary, early exit on): the same tokens and forwards. The dual cache
    treats image rows as prompt rows."""
    qs = ["What is in the picture?", "Describe it.", "Say hello."]
    ids, rows = model.image_prompts(qs, [SMALL, Image.open(SQUARE), None])
    assert [None if r is None else r.shape[0] for r in rows] == [1261, 1485, None]
    dcfg = model.decode_config(decoder="fastdllm", **GEN)
    batched = model.generate_ids(ids, dcfg, images=rows)
    alone = model.generate_ids(ids, dcfg, images=rows, batch_size=1, prompt_slot=model.engine.prompt_slot(
        [len(p) for p in ids]))
    assert _tokens(batched) == _tokens(alone) and [g.nfe for g in batched] == [g.nfe for g in alone]
    # the image decides: the same question about the other image's rows decodes otherwise
    swapped = model.generate_ids(ids[:1], dcfg, images=[rows[1][:1261]], batch_size=1,
                                 prompt_slot=model.engine.prompt_slot([len(p) for p in ids]))
    assert _tokens(swapped) != _tokens(alone[:1])


_MESH_SCRIPT = r"""
import json, sys
from PIL import Image
from polestar_jax.api import load
folder, small, square = sys.argv[1:4]
model = load(folder, mesh="data=2,model=4", compile_cache=False)
ids, rows = model.image_prompts(["What is in the picture?", "Describe it.", "Say hello."],
                                [small, Image.open(square), None])
dcfg = model.decode_config(decoder="fastdllm", gen_length=16, block_length=8)
fixed = model.generate_ids(ids, dcfg, images=rows)
running = model.generate_ids(ids, dcfg, images=rows, batch_size=1,
                             prompt_slot=model.engine.prompt_slot([len(p) for p in ids]))
print("RESULT " + json.dumps({"ids": ids, "fixed": [[list(g.token_ids), g.nfe] for g in fixed],
                              "running": [[list(g.token_ids), g.nfe] for g in running]}))
"""


def test_images_on_a_device_mesh_give_what_one_device_gives(model, folder):
    """On 8 simulated devices (mesh data=2 x model=4; a subprocess): the image-row table is replicated like the
    embedding, and a fixed batch and a running batch of one slot (its table written slot by slot) give
    the tokens and forwards of one device."""
    import os

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(folder), str(SMALL), str(SQUARE)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    ids, rows = model.image_prompts(["What is in the picture?", "Describe it.", "Say hello."],
                                    [SMALL, Image.open(SQUARE), None])
    assert got["ids"] == ids
    want = [[list(g.token_ids), g.nfe] for g in model.generate_ids(ids, model.decode_config(decoder="fastdllm", **GEN),
                                                                    images=rows)]
    assert got["fixed"] == want and got["running"] == want


def test_polestar_runs_on_image_rows_and_a_row_ignores_its_neighbour(model):
    """The LLaDA path's Polestar on LLaDA-V: image rows are prompt rows (clustered, refreshed); each row's
    tokens are the same whichever image its neighbour in the batch has (one program: batches [A, B] and
    [A, A] at one prompt slot)."""
    ids, rows = model.image_prompts(["What is in the picture?", "Describe it."], [SMALL, SQUARE])
    dcfg = model.decode_config(decoder="polestar", gen_length=8, block_length=8)
    slot = model.engine.prompt_slot([len(p) for p in ids])
    ab = model.generate_ids(ids, dcfg, images=rows, prompt_slot=slot)
    aa = model.generate_ids([ids[0]] * 2, dcfg, images=[rows[0]] * 2, rows=[0, 5], prompt_slot=slot)
    assert _tokens(aa)[0] == _tokens(ab)[0]
    assert _tokens(ab)[0] != _tokens(ab)[1] and all(g.nfe > 0 for g in ab)


def test_generate_takes_paths_pil_images_bytes_and_none(model):
    a = model.generate("What is this?", images=SMALL, decoder="fastdllm", **GEN)
    b = model.generate(["What is this?"], images=[Image.open(SMALL)], decoder="fastdllm", **GEN)
    c = model.generate(["What is this?"], images=[SMALL.read_bytes()], decoder="fastdllm", **GEN)
    assert _tokens(a) == _tokens(b) == _tokens(c) and len(a[0].token_ids) == 16
    with pytest.raises(PolestarError, match="images has 1 entries for 2 prompts"):
        model.generate(["a", "b"], images=[SMALL])
    with pytest.raises(PolestarError, match="image 0 of prompt 0: mode I"):
        model.generate(["a"], images=[Image.new("I", (4, 4))])


def test_prompt_ids_are_what_generate_decodes(model):
    """``prompt_ids`` of a LLaDA-V model renders a text-only prompt as ``generate`` does (its system message
    included), so ``generate_ids(prompt_ids(t))`` is ``generate(t)``."""
    for chat in (True, False):
        assert model.prompt_ids("Say hello.", chat) == model.image_prompts(["Say hello."], chat=chat)[0][0]
    assert model.prompt_ids("Say hello.") != model.tokenizer.chat_prompt_ids("Say hello.")  # the system message


def test_a_text_model_refuses_images():
    from polestar_jax.api import load

    with pytest.raises(PolestarError, match="takes no images"):
        load(compile_cache=False).generate(["hi"], images=[SMALL])


# ------------------------------------------------------------------------------------------ faces
def _generate_cli(argv, capsys):
    from polestar_jax import generate as gen_cli

    code = gen_cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_cli_with_an_image_equals_the_api(model, folder, capsys, tmp_path, offline_session_cache):
    code, out, err = _generate_cli(["--model", str(folder), "--image", str(SMALL), "--prompt", "What is this?",
                                    "--decoder", "fastdllm", "--gen-length", "16", "--block-length", "8", "--json",
                                    "--quiet"], capsys)
    assert code == 0, err
    want = model.generate("What is this?", images=SMALL, decoder="fastdllm", **GEN)
    assert json.loads(out)["token_ids"] == _tokens(want)[0]
    bad = tmp_path / "cat.png"
    bad.write_bytes(b"GIF89a")
    for argv, word in (([ "--image", str(bad), "--prompt", "q"], "not a readable image"),
                       (["--image", str(SMALL), "--image", str(SQUARE), "--prompt", "q"], "given 2 times for 1 prompts"),
                       (["--image", str(SMALL)], "no prompt given")):
        code, out, err = _generate_cli(["--model", str(folder), *argv], capsys)
        assert code == 2 and err.startswith("error:") and word in err and len(err.splitlines()) == 1, err
    code, out, err = _generate_cli(["--image", str(SMALL), "--prompt", "q"], capsys)  # the bundled text model
    assert code == 2 and "--image needs a LLaDA-V model" in err


def test_convert_and_load_keep_every_tensor(folder, model, tmp_path):
    """The HF folder converts to orbax and back: the tower, projector and newline come from the main
    checkpoint under the real checkpoint's names (``model.vision_tower.vision_tower.vision_model.*``)."""
    import jax

    from polestar_jax.convert.hf import convert_hf_to_orbax, convert_orbax_to_hf
    from polestar_jax.io.checkpoint import load_model
    from polestar_jax.io.safetensors_io import read_safetensors

    names = read_safetensors(str(folder / "model.safetensors"))
    assert "model.vision_tower.vision_tower.vision_model.encoder.layers.1.mlp.fc2.weight" in names
    assert {"model.mm_projector.0.weight", "model.mm_projector.2.bias", "model.image_newline"} <= set(names)
    convert_hf_to_orbax(folder, tmp_path / "conv")
    cfg, params = load_model(tmp_path / "conv")
    assert cfg == model.config
    jax.tree.map(np.testing.assert_array_equal, params, model.params)
    convert_orbax_to_hf(tmp_path / "conv", tmp_path / "back")
    back = read_safetensors(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(names)


def test_llada_v_at_real_shapes_plans_its_image_tokens():
    """LLaDA-V at its real shapes (tests/data/llada_v_config.json): 8.4B parameters (LLaDA-8B + the 26-layer
    SigLIP-so400m tower + projector); image tokens per size as the golden folder counts them; anyres_max_4
    keeps a 37-crop image under ~3.7k tokens."""
    import jax

    from polestar_jax.config import ModelConfig
    from polestar_jax.engine.plan import plan_images
    from polestar_jax.io.checkpoint import param_shapes

    cfg = ModelConfig.from_json(str(REAL))
    assert (cfg.vision.n_layers, cfg.vision.hidden_size, cfg.d_model, cfg.n_layers) == (26, 1152, 4096, 32)
    n = sum(int(np.prod(s)) for s in jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)))
    assert 8.4e9 < n < 8.5e9
    with open(GOLDEN / "cases.json") as f:
        gold = {tuple(v["image_size"]): v["n_image_tokens"] for v in json.load(f)["images"].values()}
    plans = plan_images(cfg, list(gold) + [(2304, 2304), (1920, 1080)], compile_tower=False)
    assert {p.size: p.tokens for p in plans[:len(gold)]} == gold
    assert [(p.crops, p.grid) for p in plans] == [(2, (1, 1)), (2, (1, 1)), (3, (2, 1)), (37, (6, 6)), (16, (5, 3))]
    assert max(p.tokens for p in plans) < 3700


def test_the_images_page_runs(folder, model, tmp_path, monkeypatch, capsys, offline_session_cache):
    """docs/images.md's commands and Python block run as shown, on the tiny folder in place of
    /models/llada-v (photo.png: the 40x28 golden image); the dry-run prints the golden token counts."""
    from test_readme_examples import Example, _check_output, _run_generate, blocks, commands

    exs = []  # (as tests/test_readme_examples.py reads a page; every command of this one runs)
    for b in blocks("docs/images.md"):
        if "tiny_vision" in b.text or "bench.tasks.shapes" in b.text:
            continue  # the trained test bed's section: tests/test_tiny_vision.py runs it
        if b.lang == "bash":
            exs += [Example(b.page, line, argv=argv) for line, argv, _ in commands(b)]
        elif b.lang == "python":
            exs.append(Example(b.page, b.line, code=b.text))
        elif b.lang == "text":
            exs[-1].output = b.text
    assert len(exs) == 5 and sum(ex.output is not None for ex in exs) == 2
    (tmp_path / "photo.png").write_bytes(SMALL.read_bytes())
    (tmp_path / "notes.txt").write_text("not a picture")
    monkeypatch.chdir(tmp_path)
    for ex in exs:
        if ex.code is not None:
            with contextlib.redirect_stdout(io.StringIO()) as buf:
                exec(compile(ex.code.replace("/models/llada-v", str(folder)), ex.id, "exec"), {})  # noqa: S102
            _check_output(ex, buf.getvalue(), "", 0)
            continue
        argv = [str(folder) if a == "/models/llada-v" else str(REAL) if a.endswith("llada_v_config.json") else a
                for a in ex.argv[3:]]
        code, out, err = _run_generate(argv, capsys)
        _check_output(ex, out, err, code)
        assert code == (2 if ex.output else 0), err
        if "--dry-run" in argv:
            assert "  image 384x384: grid 1x1, 2 crops, 1485 prompt tokens (tower: " in out
            assert "  image 1024x768: grid 3x2, 7 crops, 3627 prompt tokens (tower: " in out
            assert f"prompt={128 + 3627} " in out
    code, out, err = _run_generate(["--dry-run", "--image-size", "12x", "--model-config", str(REAL)], capsys)
    assert code == 2 and "--image-size takes WIDTHxHEIGHT" in err


# ------------------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def vlm_server(folder, subprocess_env):
    """(base url, process) of a server over the tiny LLaDA-V folder (as tests/test_serve.py starts one)."""
    args = ["--model", str(folder), "--port", "0", "--decoder", "fastdllm", "--max-batch", "2",
            "--max-prompt-tokens", "1792", "--max-tokens", "16", "--block-length", "8", "--quiet",
            "--served-model-name", "llada-v"]
    proc = subprocess.Popen([sys.executable, "-m", "polestar_jax.serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert m, f"no ready line: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        yield m.group(1), proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _chat(base: str, parts, **more):
    import httpx

    body = {"model": "llada-v", "max_tokens": 16, "messages": [{"role": "user", "content": parts}], **more}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=120)


def test_server_answers_image_url_parts_as_the_api_does(vlm_server, model):
    """A chat message with an image_url part (a base64 data: URL, first as the official prompt has it) gets
    the answer ``model.generate(question, images=...)`` gives; bad images and other URLs are a 400 whose
    message names the part."""
    base, _ = vlm_server
    url = _data_url(SMALL.read_bytes())
    r = _chat(base, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}])
    assert r.status_code == 200, r.text
    want = model.generate("What is this?", images=SMALL, decoder="fastdllm", **GEN)[0]
    assert r.json()["choices"][0]["message"]["content"] == want.text
    assert r.json()["usage"]["prompt_tokens"] == len(model.image_prompts(["What is this?"], [SMALL])[0][0])
    bad = {"https://example.com/cat.png": "only base64 data: URLs",
           _data_url(b"not an image"): "not a readable image",
           "data:image/png;base64,%%%": "not valid base64",
           _data_url(_png(Image.new("I;16", (8, 8)))): "16/32-bit pixels"}
    for u, word in bad.items():
        r = _chat(base, [{"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": u}}])
        err = r.json()["error"]
        assert r.status_code == 400 and word in err["message"] and err["param"] == "messages", r.text
        assert err["message"].startswith("messages: messages[0].content[1].image_url")
    r = _chat(base, [{"type": "input_audio", "input_audio": {}}])
    assert r.status_code == 400 and "unsupported content part type" in r.json()["error"]["message"]
    # images that cannot fit the server's prompt (2 x 1261 rows > 1792) are refused before the tower runs
    r = _chat(base, [{"type": "image_url", "image_url": {"url": url}}] * 2 + [{"type": "text", "text": "Two?"}])
    assert r.status_code == 400 and "take 2522 prompt rows, more than this server's 1792" in r.text, r.text


def test_the_serving_pages_image_example_runs(vlm_server, model, tmp_path, monkeypatch):
    """docs/serving.md#images: its Python example (the openai client, a data: URL) against the server."""
    pytest.importorskip("openai")
    from test_readme_examples import blocks  # tests/test_readme_examples.py

    code = next(b.text for b in blocks("docs/serving.md") if b.lang == "python" and "image_url" in b.text)
    (tmp_path / "photo.png").write_bytes(SMALL.read_bytes())
    monkeypatch.chdir(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()) as buf:
        exec(code.replace("http://127.0.0.1:8000", vlm_server[0]), {})  # noqa: S102 - the page's own example
    want = model.generate("What is in the picture?", images=SMALL, decoder="fastdllm", **GEN)[0].text
    assert buf.getvalue() == want + "\n"
