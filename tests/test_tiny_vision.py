"""The trained LLaDA-V test bed ``polestar_jax/assets/tiny_vision`` (issue #46 item 5): the API, the command
line and the server answer questions about held-out pictures of ``bench/tasks/shapes.py`` correctly, each
answer checked against the scene the picture was drawn from. Asked about colour and shape (86% / 96% held-out
exact match); count and the three-word description are weak (54% / 4%, the folder's README).

The pictures are chosen so that the two asked the same question have different answers (the answer must come
from the picture, not from the question)."""
from __future__ import annotations

import base64
import io
from pathlib import Path

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
    insts = _pairs("colour") + _pairs("shape", 2)
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


def test_the_command_line_answers_from_the_picture(tmp_path, capsys, offline_session_cache):
    """``generate --image`` (two pictures, one question each, LLaDA-V's Polestar) prints the scenes' answers."""
    from polestar_jax import generate as gen_cli

    insts = _pairs("colour", 4)
    argv = ["--model", str(ASSET), "--decoder", "polestar_v", "--cache", "prefix", "--quiet"]
    for k, inst in enumerate(insts):
        S.draw(inst.scene).save(tmp_path / f"p{k}.png")
        argv += ["--image", str(tmp_path / f"p{k}.png"), "--prompt", inst.question]
    code = gen_cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    got = [lines[lines.index(f"--- [{k}] {inst.question}") + 1] for k, inst in enumerate(insts)]
    assert got == [i.answer for i in insts]


def test_the_vision_benchmark_runs_and_scores_against_the_scenes(tmp_path):
    """``bench.bench_vision`` (smoke size): every decoder asked gets a row per task and one for all, its
    accuracy the share of exact answers, its forwards counted; the markdown names the command."""
    import json

    from bench import bench_vision

    out = tmp_path / "vision"
    assert bench_vision.main(["--n", "1", "--batch", "4", "--repeats", "1", "--decoders", "polestar_v,llada",
                              "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())["results"]
    assert {(r["decoder"], r["task"]) for r in results} == {(d, t) for d in ("polestar_v", "llada")
                                                           for t in (*S.TASK_NAMES, "all")}
    for r in results:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["nfe"] > 0
        if r["task"] != "all":
            assert r["accuracy"] in (0.0, 1.0)  # one picture per task: right or wrong
    assert "python -m bench.bench_vision --n 1" in (out / "results.md").read_text()
