"""LLaDA-V, the vision-language family (issue #46 item 1): config detection, the checkpoint names, the
pixels (bit-exact), the SigLIP tower, the projector, the splicing and the LM's first pass, against
``tests/data/llada_v_tiny_a`` (made by the official Polestar LLaDA-V code, CPU float32; README in
/work/shared/golden). Floats: ``|a - b| <= 1e-4 + 1e-4 |b|`` at float32 ``highest`` matmul precision."""
from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polestar_jax.config import ModelConfig, VisionConfig
from polestar_jax.errors import ConfigError, PolestarError
from polestar_jax.models import image as img
from polestar_jax.models import llada
from polestar_jax.models import llada_v as lv
from polestar_jax.models import vision
from polestar_jax.models.family import FAMILIES, family_of

DATA = Path(__file__).parent / "data" / "llada_v_tiny_a"
TAGS = ("sq384", "small40x28", "wide500x300")


def within(got, want) -> float:
    """The share of the golden tolerance used (<= 1 passes)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    return float((np.abs(got - want) / (1e-4 + 1e-4 * np.abs(want))).max())


@pytest.fixture(scope="module")
def cases():
    with open(DATA / "cases.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The golden model loaded from an HF folder as a user has it (the weights gunzipped next to config.json,
    the SigLIP stand-in folder beside)."""
    from polestar_jax.io.checkpoint import load_model

    folder = tmp_path_factory.mktemp("llada_v_tiny_a")
    shutil.copy(DATA / "config.json", folder / "config.json")
    shutil.copytree(DATA / "siglip_vision_tower", folder / "siglip_vision_tower")
    with gzip.open(DATA / "model.safetensors.gz") as src, open(folder / "model.safetensors", "wb") as dst:
        shutil.copyfileobj(src, dst)
    with jax.default_matmul_precision("highest"):
        cfg, params = load_model(folder)
    return cfg, params, folder


@pytest.fixture(scope="module")
def pixels(model):
    cfg = model[0]
    return {t: img.preprocess(DATA / "images" / f"{t}.png", cfg.vision) for t in TAGS}


@pytest.fixture(scope="module")
def features(model, pixels):
    """Tower features and projector rows [n, T, C] / [n, T, D] of every golden image."""
    cfg, params, _ = model
    with jax.default_matmul_precision("highest"):
        out = {}
        for t, px in pixels.items():
            f = vision.tower(params["vision"], jnp.asarray(px.pixels), cfg.vision)
            out[t] = (np.asarray(f), np.asarray(vision.project(params["projector"], f)))
    return out


# ------------------------------------------------------------------------------------------- config
def test_config_detects_llada_v_and_reads_the_tower_folder(model):
    cfg = model[0]
    assert cfg.family == "llada_v" and family_of(cfg) is FAMILIES["llada_v"]
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers, cfg.mlp_hidden_size) == (64, 4, 4, 2, 128)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.mask_token_id, cfg.eos_token_id) == (5e5, 1e-5, 126336, 126081)
    vc = cfg.vision
    # the tower folder's config has 3 layers: the official loader deletes the last one
    assert (vc.hidden_size, vc.n_layers, vc.n_heads, vc.intermediate_size, vc.patch_size) == (32, 2, 2, 64, 14)
    assert (vc.image_size, vc.patches_per_side, vc.max_num_patches, vc.model_max_length) == (384, 27, 4, 8192)
    assert len(vc.grid_pinpoints) == 36 and vc.grid_pinpoints[:2] == ((384, 384), (384, 768))
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg  # the config.json we write reads back


def test_config_without_a_tower_config_is_siglip_so400m():
    with open(DATA / "config.json") as f:
        d = json.load(f)
    with pytest.raises(ConfigError) as e:  # mm_hidden_size 32 is not the so400m tower's
        ModelConfig.from_dict(d, source="config.json")
    assert "vision_config" in str(e.value) and len(str(e.value).splitlines()) == 1
    vc = ModelConfig.from_dict({**d, "mm_hidden_size": 1152}).vision
    assert (vc.hidden_size, vc.n_layers, vc.n_heads, vc.intermediate_size) == (1152, 26, 16, 4304)
    assert vc == VisionConfig()


@pytest.mark.parametrize("change, word", [({"mm_projector_type": "linear"}, "mm_projector_type"),
                                          ({"image_aspect_ratio": "pad"}, "image_aspect_ratio"),
                                          ({"mm_patch_merge_type": "flat"}, "mm_patch_merge_type"),
                                          ({"mm_use_im_start_end": True}, "mm_use_im_start_end"),
                                          ({"image_grid_pinpoints": "six"}, "image_grid_pinpoints")])
def test_config_rejects_what_it_cannot_run(change, word):
    with open(DATA / "config.json") as f:
        d = {**json.load(f), "vision_config": {"hidden_size": 32, "num_hidden_layers": 3,
                                               "num_attention_heads": 2, "intermediate_size": 64}}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({**d, **change}, source="config.json")
    assert word in str(e.value) and len(str(e.value).splitlines()) == 1


# ------------------------------------------------------------------------------------------ checkpoint
def test_checkpoint_maps_every_tensor_both_ways(model):
    from polestar_jax.io.checkpoint import params_to_hf
    from polestar_jax.io.safetensors_io import read_safetensors

    cfg, params, folder = model
    assert params["vision"]["blocks"]["q_w"].shape == (2, 32, 32) and params["vision"]["patch_w"].shape == (
        32, 3, 14, 14)
    assert params["projector"]["w1"].shape == (32, 64) and params["image_newline"].shape == (64,)
    hf = read_safetensors(str(folder / "model.safetensors"))
    back = params_to_hf(params, cfg)
    assert sorted(back) == sorted(hf)
    for name in back:
        np.testing.assert_array_equal(back[name], np.asarray(hf[name]), err_msg=name)


# ------------------------------------------------------------------------------------------ pixels
@pytest.mark.parametrize("tag", TAGS)
def test_pixels_are_bit_exact(cases, model, pixels, tag):
    want = cases["images"][tag]
    im = img.as_rgb(DATA / "images" / f"{tag}.png")
    crops, grid = img.crops(im, model[0].vision)
    assert [hashlib.sha256(c.tobytes()).hexdigest() for c in crops] == want["crops_uint8_sha256"]
    px = pixels[tag]
    assert [1, *px.pixels.shape] == want["pixel_shape"] and px.pixels.dtype == np.float32
    assert hashlib.sha256(px.pixels.tobytes()).hexdigest() == want["pixel_sha256_f32"]
    assert list(px.size) == want["image_size"]
    assert [grid[0] * 384, grid[1] * 384] == want["grid_best_resolution"] and px.grid == grid


def test_a_file_that_is_not_an_image_is_one_line(tmp_path):
    bad = tmp_path / "x.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(PolestarError) as e:
        img.as_rgb(bad)
    assert "not a readable image" in str(e.value) and len(str(e.value).splitlines()) == 1


# ------------------------------------------------------------------------------------ tower, projector
@pytest.mark.parametrize("tag", TAGS)
def test_vision_features_and_projector_rows(features, tag):
    f, p = features[tag]
    assert within(f[:, ::9], np.load(DATA / f"vision_features_{tag}_sub9.npy")) <= 1.0
    assert within(p[:, ::9], np.load(DATA / f"projector_out_{tag}_sub9.npy")) <= 1.0


# -------------------------------------------------------------------------------------------- splicing
def _runs(idx):
    """[start, len] runs of consecutive indices (-1 runs count the newline rows)."""
    out: list[list[int]] = []
    for v in map(int, idx):
        if out and ((v == -1 and out[-1][0] == -1) or (v != -1 and out[-1][0] != -1
                                                        and sum(out[-1]) == v)):
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _expand(runs):
    return np.concatenate([np.full(n, -1) if s == -1 else np.arange(s, s + n) for s, n in runs])


@pytest.mark.parametrize("tag", TAGS)
def test_image_token_layout(cases, model, pixels, features, tag):
    """Unpad, the newline column and the base crop first: the spliced rows are the golden's rows."""
    cfg, params, _ = model
    want = cases["images"][tag]
    px = pixels[tag]
    lay = lv.layout(px.size, px.grid, cfg.vision)
    assert lay.resize is None
    grid = np.concatenate([lay.grid, np.full((lay.grid.shape[0], 1), -1)], axis=1).reshape(-1)
    ours = np.concatenate([np.arange(729), grid])
    gold = _expand(want["image_token_layout_runs"])
    assert len(ours) == len(gold) == want["n_image_tokens"] == lv.n_image_rows(px.size, cfg.vision)
    proj = features[tag][1]
    rows = np.asarray(lv.image_rows(jnp.asarray(proj), px.size, px.grid, params["image_newline"], cfg.vision))
    table = np.concatenate([proj.reshape(-1, proj.shape[-1]), np.asarray(params["image_newline"])[None]])
    # the golden names rows by value: a 384x384 image's grid tile is crop 0 again, so compare the rows
    np.testing.assert_array_equal(rows, table[gold])
    if tag != "sq384":
        assert _runs(ours) == want["image_token_layout_runs"]


def test_unpad_cuts_the_letterbox_side():
    assert lv.unpad_bounds((27, 54), (500, 300)) == (0, 27, 4, 50)  # wide picture on a 2x1 grid: columns
    assert lv.unpad_bounds((27, 27), (40, 28)) == (4, 23, 0, 27)  # wide image on one tile: rows
    assert lv.unpad_bounds((54, 27), (300, 700)) == (0, 54, 2, 25)  # int(300 * 54/700) = 23 of 27 columns


def test_large_grids_are_resized_bilinearly():
    """anyres_max_4: a picture over 1.1 x 4 tiles' worth of patches is resized (PyTorch's bilinear,
    half-pixel centres, no antialias): checked against a per-pixel reference and the row count."""
    vc = VisionConfig(hidden_size=8, n_layers=1, n_heads=2, intermediate_size=8)
    assert img.select_best_resolution((1000, 700), vc.grid_pinpoints) == (1152, 768)  # a 3x2 grid
    lay = lv.layout((1000, 700), (3, 2), vc)  # 54 x 81 patches, 77 columns unpadded -> t = 1.194
    assert lay.grid.shape == (54, 77) and lay.resize == (45, 64)
    assert lv.n_image_rows((1000, 700), vc) == 729 + 45 * 65
    feats = jnp.asarray(np.random.default_rng(1).normal(size=(7, 729, 4)), jnp.float32)
    rows = lv.image_rows(feats, (1000, 700), (3, 2), jnp.full((4,), 9.0), vc)
    assert rows.shape == (729 + 45 * 65, 4) and (np.asarray(rows[729 + 64::65]) == 9.0).all()
    x = np.random.default_rng(0).normal(size=(5, 7, 3)).astype(np.float32)
    got = np.asarray(lv.bilinear_resize(jnp.asarray(x), 3, 4))
    want = np.zeros((3, 4, 3), np.float32)
    for i in range(3):
        for j in range(4):
            sy, sx = max((i + 0.5) * 5 / 3 - 0.5, 0.0), max((j + 0.5) * 7 / 4 - 0.5, 0.0)
            y0, x0 = int(sy), int(sx)
            y1, x1 = min(y0 + 1, 4), min(x0 + 1, 6)
            a, b = sy - y0, sx - x0
            want[i, j] = ((1 - a) * ((1 - b) * x[y0, x0] + b * x[y0, x1]) + a * ((1 - b) * x[y1, x0] + b * x[y1, x1]))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------- the LM's first pass
@pytest.fixture(scope="module")
def first_pass(model, cases):
    """Per logits case: the spliced prompt rows and the sampler's first pass (prompt ++ 64 [MASK] rows,
    positions 0..L-1, no cache)."""
    cfg, params, _ = model
    out = {}
    with jax.default_matmul_precision("highest"):
        for tag, lc in cases["logits_cases"].items():
            pe = lv.prompt_embeddings(params, cfg, lc["input_ids"], [DATA / "images" / f"{tag}.png"])
            mask = jnp.broadcast_to(params["wte"][cfg.mask_token_id], (64, cfg.d_model))
            x = jnp.concatenate([pe, mask])[None]  # [1, L, D]
            pos = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
            res = lv.forward(params, None, cfg, pos, pos, None, embeds=x)
            k_rot = llada.Rope.at(pos, cfg).rotate(res.kv[0][0])  # layer 0's keys as the reference caches them
            out[tag] = (pe, res.h, k_rot)
    return out


@pytest.mark.parametrize("tag", ("sq384", "wide500x300"))
def test_spliced_prompt_embeddings(cases, first_pass, tag):
    lc = cases["logits_cases"][tag]
    pe = np.asarray(first_pass[tag][0])
    assert pe.shape == (lc["prompt_len"], 64)
    assert within(pe[::4], np.load(DATA / lc["prompt_embeds_file"])) <= 1.0


@pytest.mark.parametrize("tag", ("sq384", "wide500x300"))
def test_first_pass_logits_hidden_and_rotated_keys(cases, model, first_pass, tag):
    cfg, params, _ = model
    lc = cases["logits_cases"][tag]
    with open(DATA / "recipe.json") as f:
        active = json.load(f)["active_out"]
    _, h, k_rot = first_pass[tag]
    assert h.shape[1] == lc["total_len"]
    r0, r1 = lc["rows"]
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(lv.lm_head(params, h[:, r0:r1], cfg))[0]
        final = np.asarray(llada.rms_norm(h[:, r0:r1], params["ln_f"], cfg.rms_norm_eps))[0]
        sample = np.r_[0:r0:7, r0:r1]  # every 7th prompt row and the compared rows, over the full vocabulary
        full = lv.lm_head(params, h[:, sample], cfg)[0]
        am, mp = np.asarray(jnp.argmax(full, -1)), np.asarray(jnp.max(jax.nn.softmax(full, -1), -1))
    assert within(logits[:, active], np.load(DATA / lc["logits_file"])) <= 1.0
    assert lc["inactive_columns_all_zero"] and not np.delete(logits, active, axis=1).any()
    assert within(final, np.load(DATA / lc["final_hidden_file"])) <= 1.0
    assert within(np.asarray(k_rot)[0][:, r0:r1], np.load(DATA / lc["k_layer0_file"])) <= 1.0
    np.testing.assert_array_equal(am, np.asarray(lc["argmax_all_rows"])[sample])
    assert within(mp, np.asarray(lc["maxprob_all_rows"])[sample]) <= 1.0


def test_forward_of_embeddings_is_the_forward_of_ids_also_with_grouped_kv_heads():
    """``forward(embeds=embed(ids))`` is bit-identical to ``forward(ids)`` (LLaDA and Dream untouched), and
    the family runs grouped KV heads (random weights)."""
    base = ModelConfig.from_json(str(DATA))
    cfg = ModelConfig(**{**base.__dict__, "n_kv_heads": 2, "vocab_size": 300, "embedding_size": 300,
                         "mask_token_id": 299, "eos_token_id": 298, "pad_token_id": 298})
    params = lv.init_params(cfg, jax.random.PRNGKey(0))
    ids = jnp.asarray([[5, 6, 7, 8, 9, 299, 299]], jnp.int32)
    pos = jnp.arange(7, dtype=jnp.int32)[None]
    a = lv.forward(params, ids, cfg, pos, pos)
    b = lv.forward(params, None, cfg, pos, pos, embeds=lv.embed(params, ids))
    np.testing.assert_array_equal(np.asarray(a.h), np.asarray(b.h))
    assert a.kv[0].shape == (2, 1, 2, 7, 16)  # [N, b, KV, L, hd]
    rows = lv.encode_image(params, img.as_rgb(DATA / "images" / "small40x28.png"), cfg)
    pe = lv.splice(params, [1, 2, lv.IMAGE_TOKEN_INDEX, 3], [rows], cfg)
    assert pe.shape == (3 + 1261, 64)
    np.testing.assert_array_equal(np.asarray(pe[2:-1]), np.asarray(rows))
    with pytest.raises(PolestarError):
        lv.splice(params, [1, 2, 3], [rows], cfg)


# --------------------------------------------------------------------------- decoding: the prefix cache
def test_image_rows_as_ids_embed_to_the_spliced_prompt(model, first_pass, cases):
    """``with_image_rows``: the placeholder becomes ids past the embedding that :func:`llada_v.embed` reads
    from the image-row table, so every decoder sees the spliced prompt; text-only ids embed as LLaDA's."""
    cfg, params, _ = model
    lc = cases["logits_cases"]["sq384"]
    rows = lv.encode_image(params, DATA / "images" / "sq384.png", cfg)
    (ids,), with_rows = lv.with_image_rows(params, [lc["input_ids"]], [[rows]], cfg)
    assert len(ids) == lc["prompt_len"] and max(ids) == params["wte"].shape[0] + 1485 - 1
    got = lv.embed(with_rows, jnp.asarray([ids], jnp.int32))[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(first_pass["sq384"][0]))
    text = jnp.asarray([[1, 2, 126336]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(lv.embed(params, text)), np.asarray(llada.embed(params, text)))


def test_decoding_heads_suppress_the_official_ids(model):
    cfg, params, _ = model
    h = jax.random.normal(jax.random.PRNGKey(0), (1, 3, cfg.d_model))
    got = np.asarray(FAMILIES["llada_v"].head_at(params, h, cfg, 0, 3))
    raw = np.asarray(lv.lm_head(params, h, cfg))
    keep = np.setdiff1d(np.arange(raw.shape[-1]), lv.SUPPRESS_IDS)
    assert (got[..., list(lv.SUPPRESS_IDS)] == -1e30).all()
    np.testing.assert_array_equal(got[..., keep], raw[..., keep])
    assert FAMILIES["llada"].suppress_ids == () == FAMILIES["dream"].suppress_ids


def _local_prompts(params, cases, rows, cfg):
    """The cases' prompts as the engine takes them: each one's ids with its image's ``rows`` named ``E + j``,
    and per prompt those rows (:mod:`polestar_jax.engine.images` places them in the batch's table)."""
    local = [lv.with_image_rows({"wte": params["wte"]}, [c["input_ids"]], [[rows]], cfg) for c in cases]
    return [ids for (ids,), _ in local], [t["image_rows"] for _, t in local]


@pytest.mark.parametrize("names", [("fastdllm_prefix/sq384/q0/g64_b16_s64", "fastdllm_prefix/sq384/q1/g64_b16_s64")])
def test_golden_prefix_cache_cases(model, cases, names):
    """The official LLaDA-V sampler without clusters (Fast-dLLM's prefix cache: a full pass per block, then
    passes of block + suffix over the cached prefix, four ids never committed, no step after a pass that
    filled the block): output ids, NFE, per-block NFE and the commits of every pass, exactly. The image
    rows run as prompt ids through the project's own ``fastdllm`` prefix-cache policy; two prompts of
    different lengths (1572, 1584 rows) in one batch each give the reference's batch-1 result."""
    from engines import generate  # tests/engines.py

    from polestar_jax import crosscheck as cc
    from polestar_jax.config import DecodeConfig

    cfg, params, _ = model
    batch = [next(c for c in cases["generate_cases"] if c["name"] == n) for n in names]
    rows = lv.encode_image(params, DATA / batch[0]["image"], cfg)
    prompts, images = _local_prompts(params, batch, rows, cfg)
    assert [len(p) for p in prompts] == [c["prompt_len"] for c in batch]
    s = batch[0]["settings"]
    dcfg = DecodeConfig(decoder="fastdllm", cache="prefix", gen_length=s["gen_length"],
                        block_length=s["block_length"], steps=s["steps"], threshold=s["threshold"],
                        step_after_full_pass=False)
    with jax.default_matmul_precision("highest"):
        res = generate(params, cfg, prompts, dcfg, prompt_slot=max(map(len, prompts)), images=images)
    for row, case in enumerate(batch):
        traj = [[tuple(c) for c in step["commits"]] for step in case["trajectory"]]
        r = cc._check_generation(case["name"], res, row, len(prompts[row]), case["generated_ids"], case["nfe"],
                                 traj, None, [b["block_nfe"] for b in case["block_stats"]], exact_trajectory=True)
        assert r.status == "pass", r.detail
        assert all(p["kind"] in ("block_start", "decode") for p in case["passes"]) and len(case["passes"]) == case["nfe"]


# ------------------------------------------------------------------ decoding: LLaDA-V's Polestar (polestar_v)
@pytest.mark.parametrize("names", [("polestar/sq384/q1/g64_b16_s64", "polestar/sq384/q2/g64_b16_s64")])
def test_golden_polestar_v_cases(model, cases, names):
    """The official LLaDA-V Polestar (one k-means over the final hidden states of the prompt and a window,
    refreshes from the smallest selected position with a fresh cache, cosine-drift early commits) as decoder
    ``polestar_v``, with only the reference's k-means draws injected (labels, cluster choices, pass ranges,
    drift and every commit computed here): output ids, NFE, each block's NFE, the commits of every pass and
    the kind and first position of every pass, exactly; two prompts (1584, 1579 rows) in one batch each give
    the reference's batch-1 result."""
    from engines import generate  # tests/engines.py

    from polestar_jax import crosscheck as cc

    cfg, params, _ = model
    batch = [next(c for c in cases["generate_cases"] if c["name"] == n) for n in names]
    rows = lv.encode_image(params, DATA / batch[0]["image"], cfg)
    prompts, images = _local_prompts(params, batch, rows, cfg)
    dcfg = cc.llada_v_decode_config(batch[0])
    assert dcfg.decoder == "polestar_v" and dcfg.cache == "prefix"
    slot = -(-max(map(len, prompts)) // 16) * 16
    replay = cc.llada_v_replay(str(DATA), batch, dcfg, slot, force=False)  # the draws only
    with jax.default_matmul_precision("highest"):
        res = generate(params, cfg, prompts, dcfg, prompt_slot=slot, replay=replay, images=images)
    for row, case in enumerate(batch):
        traj = [[tuple(c) for c in step["commits"]] for step in case["trajectory"]]
        r = cc._check_generation(case["name"], res, row, len(prompts[row]), case["generated_ids"], case["nfe"],
                                 traj, None, [b["block_nfe"] for b in case["block_stats"]], exact_trajectory=True)
        assert r.status == "pass", r.detail
        assert cc.llada_v_passes(res, row, slot - len(prompts[row])) == [(p["kind"], p["start"])
                                                                         for p in case["passes"]]
        assert int(res.polestar["refresh_steps"][row].sum()) == sum(p["kind"] == "cluster_refresh"
                                                                    for p in case["passes"]) > 0
        assert res.polestar["early"][row] > 0  # early commits took part


def test_polestar_v_configuration_is_checked():
    from polestar_jax.config import DecodeConfig, PolestarConfig

    base = dict(decoder="polestar_v", gen_length=64, block_length=16, threshold=0.9)
    DecodeConfig(cache="prefix", polestar=PolestarConfig(top_k=2, early_threshold=None), **base)
    for kw, word in (({"cache": "dual"}, "prefix cache"),
                     ({"cache": "prefix", "polestar": PolestarConfig(windowed_period=0)}, "windowed_period"),
                     ({"cache": "prefix", "polestar": PolestarConfig(early_threshold=0.95)}, "early_threshold")):
        with pytest.raises(ConfigError) as e:
            DecodeConfig(**base, **kw)
        assert word in str(e.value) and len(str(e.value).splitlines()) == 1


def test_polestar_v_rows_decode_alone_in_any_batch(tiny_a, tiny_a_cases):
    """Beyond the reference (batch 1): ``polestar_v`` with its own k-means draws on a text model, three
    prompts of different lengths in one lockstep batch and in a running batch of two slots (rows inserted at
    block boundaries, the per-row program): every row decodes the same tokens with the same forwards, and the
    refreshes and early commits take part."""
    from engines import engine_for

    from polestar_jax.config import DecodeConfig, PolestarConfig

    cfg, params = tiny_a
    prompts = [tiny_a_cases["generate_cases"][i]["prompt_ids"] for i in (0, 39, 78)]
    assert len({len(p) for p in prompts}) == 3
    dcfg = DecodeConfig(decoder="polestar_v", cache="prefix", gen_length=32, block_length=8, threshold=0.7,
                        early_exit=False, polestar=PolestarConfig(early_threshold=0.3, gate_scale=0.5))
    eng = engine_for(params, cfg)
    fixed = eng.generate(prompts, dcfg)
    running = eng.generate(prompts, dcfg, batch_size=2)
    for a, b in zip(fixed.rows, running.rows):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.block_nfe, b.block_nfe)
    assert sum(int(r.polestar["refresh_steps"].sum()) for r in fixed.rows) > 0
    assert sum(int(r.polestar["early"]) for r in fixed.rows) > 0
