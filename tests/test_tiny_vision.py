"""The trained LLaDA-V test bed ``polestar_jax/assets/tiny_vision`` (issue #46 item 5): the API, the command
line and the server answer questions about held-out pictures of ``bench/tasks/shapes.py`` correctly, each
answer checked against the scene the picture was drawn from; docs/images.md's test-bed examples run as shown.

The pictures are chosen so that the two asked the same question have different answers (the answer must come
from the picture, not from the question)."""
from __future__ import annotations

import base64
import contextlib
import io
import shlex
from pathlib import Path

import numpy as np
import pytest

from bench.tasks import shapes as S

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "polestar_jax" / "assets" / "tiny_vision"


def _pairs(task: str, start: int = 0, n: int = 2) -> list[S.Instance]:
    """``n`` held-out instances of ``task`` from evaluation index ``start`` on, with pairwise different answers."""
    out: list[S.Instance] = []
    i = start
    while len(out) < n:
        inst = S.eval_instances(task, 1, i)[0]
        if all(inst.answer != o.answer for o in out):
            out.append(inst)
        i += 1
    return out


@pytest.fixture(scope="module")
def model():
    from polestar_jax.api import load

    return load(str(ASSET), compile_cache=False)


def test_the_folder_is_a_small_llada_v_with_its_decoding_lengths(model):
    cfg = model.config
    assert cfg.family == "llada_v" and model.takes_images and cfg.vision.grid_pinpoints == ((384, 384),)
    assert sum(f.stat().st_size for f in ASSET.iterdir()) < 4 * 2**20
    d = model.decode_config()
    assert (d.gen_length, d.block_length) == (24, 8) and d.gen_length >= S.MAX_ANSWER_CHARS


@pytest.mark.parametrize("decoder", ["polestar", "polestar_v"])
def test_the_api_answers_from_the_picture(model, decoder):
    """``model.generate(prompts, images=[...])`` (PIL images and PNG bytes): LLaDA-V's Polestar on its prefix
    cache, and the LLaDA path's Polestar (the default decoder) on the dual cache."""
    insts = _pairs("describe") + _pairs("count", 2)
    pics = [S.draw(i.scene) for i in insts]
    pics[1] = _png(pics[1])
    knobs = {"decoder": "polestar_v", "cache": "prefix"} if decoder == "polestar_v" else {}
    out = model.generate([i.question for i in insts], images=pics, **knobs)
    assert [g.text for g in out] == [i.answer for i in insts]


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_the_server_answers_image_url_parts(model):
    """An OpenAI chat request with a base64 ``data:`` URL image part, then the question (the app the server
    builds, spoken to in-process), answers from the picture."""
    from fastapi.testclient import TestClient

    from polestar_jax.serving.app import ServerLimits, create_app
    from polestar_jax.serving.scheduler import Scheduler

    dcfg = model.decode_config()
    scheduler = Scheduler(model.engine, dcfg, 2, 336, sampling=True).start()
    insts = _pairs("shape", 4)
    try:
        with TestClient(create_app(model, scheduler, ServerLimits(336, dcfg.gen_length, dcfg.block_length),
                                   "tiny_vision")) as http:
            got = []
            for inst in insts:
                url = "data:image/png;base64," + base64.b64encode(_png(S.draw(inst.scene))).decode()
                r = http.post("/v1/chat/completions", json={
                    "model": "tiny_vision", "max_tokens": dcfg.gen_length,
                    "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                              {"type": "text", "text": inst.question}]}]})
                assert r.status_code == 200, r.text
                got.append(r.json()["choices"][0]["message"]["content"])
    finally:
        scheduler.stop()
    assert got == [i.answer for i in insts]


def _section(page: str, heading: str) -> list:
    from test_readme_examples import blocks  # tests/test_readme_examples.py

    text = (REPO / page).read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    first, last = text[:start].count("\n") + 1, text[:end].count("\n") + 1 if end >= 0 else 10**9
    return [b for b in blocks(page) if first <= b.line <= last]


def test_the_images_page_test_bed_section_runs(model, tmp_path, monkeypatch, capsys, offline_session_cache):
    """docs/images.md's test-bed section: its commands (draw a held-out picture, ask the command line about
    it) run; the drawing prints the scene's answers and the command line prints the answer the page gives,
    which is the scene's."""
    from test_readme_examples import commands

    from polestar_jax import generate as gen_cli

    monkeypatch.chdir(tmp_path)
    truth, asked = None, 0
    for b in _section("docs/images.md", "## A trained test bed"):
        assert b.lang == "bash", f"{b.page}:{b.line}: only commands in this section"
        for _, argv, answer in commands(b):
            if argv[:3] == ["python", "-m", "bench.tasks.shapes"]:
                assert S.main(argv[3:]) == 0
                sc = S.scene(np.random.default_rng(int(argv[argv.index("--seed") + 1])))
                truth = {q: S.answer(t, sc) for t, q in S.QUESTIONS.items()}
                assert capsys.readouterr().out.splitlines() == [f"{q} {a}" for q, a in truth.items()]
                continue
            assert argv[:3] == ["python", "-m", "polestar_jax.generate"] and truth, shlex.join(argv)
            args = [str(ASSET) if a == "polestar_jax/assets/tiny_vision" else a for a in argv[3:]]
            code = gen_cli.main(args)
            out, err = capsys.readouterr()
            assert code == 0, err
            assert answer is not None and out.splitlines()[0] == answer == truth[args[args.index("--prompt") + 1]]
            asked += 1
    assert asked >= 2
