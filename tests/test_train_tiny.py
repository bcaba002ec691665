"""bench/train_tiny.py on a tiny configuration: the loss falls, and save + resume reproduces an
uninterrupted run exactly."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import tasks as T
from bench import train_tiny as TT

# A tiny model so a few dozen steps take a few seconds on one core.
TINY = TT.TrainConfig(seed=3, steps=24, batch=8, n_layers=2, d_model=32, n_heads=2, mlp_hidden=64,
                      lr=3e-3, warmup=4, end_lr_ratio=0.5)


def _run(tc, out, **kw):
    kw.setdefault("eval_every", 0)
    return TT.train(tc, str(out), save_every=1000, log_every=1000, verbose=False, **kw)


def test_batch_layout():
    from polestar_jax.io.tokenizer import asset_model_dir, load_tokenizer

    tok = load_tokenizer(asset_model_dir(TT.TOKENIZER_SOURCE))
    batch, rows = TT.make_batch(T.train_rng(0), TINY, tok)
    L = TINY.prompt_slot + TINY.gen_length
    assert batch["ids"].shape == (TINY.batch, L) and len(rows) == TINY.batch
    for r, (task, prompt, answer) in enumerate(rows):
        s = int(batch["start"][r])
        ids = batch["ids"][r]
        assert ids[:s].tolist() == tok.chat_prompt_ids(prompt)  # the prompt first (left-aligned)
        assert batch["valid"][r].tolist() == [True] * (s + TINY.gen_length) + [False] * (L - s - TINY.gen_length)
        n = len(answer)
        assert ids[s:s + n].tolist() == tok.encode(answer)  # then the answer, padded with EOS to G
        assert ids[s + n:s + TINY.gen_length].tolist() == [tok.eos_token_id] * (TINY.gen_length - n)
        assert T.decode_answer(tok, ids[s:s + TINY.gen_length]) == answer
        assert T.score(task, prompt, answer)


def test_loss_falls_and_resume_is_exact(tmp_path):
    full = _run(TINY, tmp_path / "a")
    losses = [full["losses"][s] for s in range(TINY.steps)]
    assert all(np.isfinite(losses))
    assert np.mean(losses[-6:]) < np.mean(losses[:4]) - 0.5, losses

    part = _run(TINY, tmp_path / "b", stop_at=10)
    assert sorted(part["losses"]) == list(range(10))
    with pytest.raises(TT.TrainError, match="already holds a checkpoint"):  # refuses to overwrite without --resume
        _run(TINY, tmp_path / "b")
    with pytest.raises(TT.TrainError, match="configuration differs"):  # refuses a different configuration
        _run(dataclasses.replace(TINY, lr=1e-3), tmp_path / "b", resume=True)
    rest = _run(TINY, tmp_path / "b", resume=True)
    assert sorted(rest["losses"]) == list(range(10, TINY.steps))
    resumed = [part["losses"][s] for s in range(10)] + [rest["losses"][s] for s in range(10, TINY.steps)]
    assert resumed == losses  # bit-identical
    assert int(rest["state"]["step"]) == TINY.steps
    for a, b in zip(*(TT.jax.tree.leaves(r["state"]["params"]) for r in (full, rest))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert rest["meta"]["train_seconds"] > part["meta"]["train_seconds"]


def test_export_loads_back(tmp_path):
    from polestar_jax.io.checkpoint import load_model
    from polestar_jax.io.tokenizer import load_tokenizer

    res = _run(TINY, tmp_path / "c", stop_at=2)  # same configuration: reuses the compiled step
    # --export-only reads the checkpoint back without training, with the configuration it was saved with
    again, tc = TT.load_checkpoint(str(tmp_path / "c"))
    assert tc == TINY and int(again["state"]["step"]) == 2
    for x, y in zip(jax.tree.leaves(res["state"]["params"]), jax.tree.leaves(again["state"]["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    acc = TT.export(res, TINY, str(tmp_path / "model"), eval_n=1)
    assert set(acc) == set(T.TASK_NAMES)
    cfg, _ = load_model(str(tmp_path / "model"))
    tok = load_tokenizer(str(tmp_path / "model"))
    assert cfg.vocab_size == tok.vocab_size and cfg.mask_token_id == tok.mask_token_id
    assert tok.chat_template
    readme = (tmp_path / "model" / "README.md").read_text()
    assert "exact match" in readme and "copy" in readme
    # an export before the end of the schedule says where the schedule ends
    assert "Training: 2 steps (schedule: 24 steps) of batch 8" in readme and "at step 24," in readme


def test_init_from_starts_at_those_weights_and_eval_tasks_pick_the_evaluation(tmp_path):
    """``init_from`` (fine-tuning) starts the run at a model folder's weights exactly; a folder of other
    shapes is refused in one line; ``eval_tasks`` chooses what the evaluations score."""
    from polestar_jax.io.checkpoint import load_model

    base = _run(TINY, tmp_path / "base", stop_at=2)
    TT.export(base, TINY, str(tmp_path / "model"), eval_n=1)
    _, want = load_model(str(tmp_path / "model"), dtype="float32")
    tc = dataclasses.replace(TINY, init_from=str(tmp_path / "model"), eval_tasks=("copy", "remove"))
    tok = TT.load_tokenizer(TT.asset_model_dir(TT.TOKENIZER_SOURCE))
    mcfg = TT.model_config(tc, tok)
    got = TT.init_state(tc, mcfg)["params"]
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert TT.TrainConfig.from_json(tc.to_json()) == tc
    wide = dataclasses.replace(tc, d_model=64, mlp_hidden=128)
    with pytest.raises(TT.TrainError, match="shapes differ"):
        TT.init_state(wide, TT.model_config(wide, tok))
    assert set(TT.evaluate(got, mcfg, tok, 1, tc)) == {"copy", "remove"}


def test_answer_mask_block_structure():
    """Block-structured rows: clean blocks, then the current block masked where the independent draw masks it,
    then masked blocks; ``block_mask_prob=0`` is independent masking alone (old runs replay unchanged)."""
    key, b, G, B = jax.random.PRNGKey(5), 256, 32, 8
    iid = TT.answer_mask(key, b, G, 1e-3, B, 0.0)
    assert not np.asarray(iid.structured).any()
    mixed = TT.answer_mask(key, b, G, 1e-3, B, 0.5)
    np.testing.assert_array_equal(np.asarray(mixed.t), np.asarray(iid.t))
    s = np.asarray(mixed.structured)
    assert 0.35 < s.mean() < 0.65
    m, m0 = np.asarray(mixed.masked), np.asarray(iid.masked)
    np.testing.assert_array_equal(m[~s], m0[~s])
    starts = set()
    for r in np.flatnonzero(s):
        # the block start c is the first position of the first fully-masked tail that follows a clean prefix
        cands = [c for c in range(0, G, B) if not m[r, :c].any() and m[r, c + B:].all()
                 and (m[r, c:c + B] == m0[r, c:c + B]).all()]
        assert cands, (r, m[r].astype(int))
        starts.update(cands)
    assert starts == set(range(0, G, B))  # every block start is drawn


def test_train_config_validates():
    with pytest.raises(ValueError, match="block_mask_prob"):
        dataclasses.replace(TINY, block_mask_prob=1.5)
    with pytest.raises(ValueError, match="multiple of block_length"):
        dataclasses.replace(TINY, gen_length=30)
    with pytest.raises(TT.TrainError, match="block_mask_prob"):
        TT.preset_config("tiny_long", block_mask_prob=-0.1)
    assert TT.preset_config("tiny_long").block_mask_prob == 0.5
    for bad, match in [(dict(steps=0), "steps must be positive"), (dict(lr=float("nan")), "lr must be"),
                       (dict(tasks=("copy", "nope")), "unknown task"), (dict(task_weights=(1.0,)), "2 tasks"),
                       (dict(task_weights=(0.0, 0.0)), "not all 0"), (dict(task_weights=(2.0, -1.0)), ">= 0"),
                       (dict(tasks=()), "at least one task")]:
        with pytest.raises(TT.TrainError, match=match):
            dataclasses.replace(TINY, **{"tasks": ("copy", "remove"), **bad})


def test_task_weights_flag():
    """``--task-weights`` changes the named weights and keeps the preset's others; bad items are one-line
    errors (exit 2 from ``main``), never a traceback."""
    base = TT.preset_config("tiny_long")
    w = TT.parse_task_weights("long_sort=2, long_copy=0.25", base)
    i, j = base.tasks.index("long_sort"), base.tasks.index("long_copy")
    assert (w[i], w[j]) == (2.0, 0.25)
    assert [x for k, x in enumerate(w) if k not in (i, j)] == [x for k, x in enumerate(base.task_weights)
                                                                if k not in (i, j)]
    two = dataclasses.replace(TINY, tasks=("copy", "remove"))
    assert TT.parse_task_weights("copy=3", two) == (3.0, 1.0)  # no weights of its own: 1 each
    for spec, match in [("long_sort", "not task=weight"), ("add=1", "not a task of this run"),
                        ("long_sort=x", "not a number"), ("long_sort=-1", ">= 0"), ("long_sort=inf", ">= 0")]:
        with pytest.raises(TT.TrainError, match=match):
            TT.parse_task_weights(spec, base)


def test_main_errors_are_one_line(tmp_path, capsys):
    for argv, match in [(["--out", str(tmp_path / "x"), "--preset", "tiny_long", "--task-weights", "long_sort"],
                         "not task=weight"),
                        (["--out", str(tmp_path / "x"), "--steps", "0"], "steps must be positive"),
                        (["--out", str(tmp_path / "x"), "--export-only"], "needs --export")]:
        assert TT.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and match in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()


def test_loss_falls_with_block_masks(tmp_path):
    res = _run(dataclasses.replace(TINY, block_mask_prob=0.5), tmp_path / "blk")
    losses = [res["losses"][s] for s in range(TINY.steps)]
    assert all(np.isfinite(losses))
    assert np.mean(losses[-6:]) < np.mean(losses[:4]) - 0.5, losses


def test_resume_does_not_need_the_init_from_folder(tmp_path):
    """A fine-tuning run resumes after its starting folder is gone (the checkpoint holds step 0's weights
    and more), keeps its own ``init_from``, and refuses ``--init-from`` together with ``--resume``."""
    import shutil

    base = _run(TINY, tmp_path / "base", stop_at=2)
    TT.export(base, TINY, str(tmp_path / "start"), eval_n=1)
    tc = dataclasses.replace(TINY, steps=6, init_from=str(tmp_path / "start"))
    whole = _run(tc, tmp_path / "whole")
    _run(tc, tmp_path / "part", stop_at=3)
    shutil.rmtree(tmp_path / "start")
    rest = _run(dataclasses.replace(tc, init_from=None), tmp_path / "part", resume=True)
    assert [rest["losses"][s] for s in range(3, 6)] == [whole["losses"][s] for s in range(3, 6)]
    assert rest["meta"]["train_config"]["init_from"] == str(tmp_path / "start")
    with pytest.raises(TT.TrainError, match="--init-from only"):
        TT._main(["--out", str(tmp_path / "part"), "--resume", "--init-from", "tiny_tasks"])


def test_main_resumes_with_the_checkpoints_configuration(tmp_path, capsys):
    """``--resume`` continues a run whose seed, learning rate and task mix are not the preset's without
    repeating them (only ``--steps`` may change), and refuses a flag that contradicts the checkpoint."""
    tc = dataclasses.replace(TINY, seed=7, lr=2e-3, tasks=("copy", "remove"), task_weights=(3.0, 1.0))
    out = tmp_path / "run"
    _run(tc, out, stop_at=3)
    quiet = ["--eval-every", "0", "--save-every", "1000", "--log-every", "1000"]
    assert TT.main(["--out", str(out), "--resume", "--steps", "5", *quiet]) == 0
    res, saved = TT.load_checkpoint(str(out))
    assert int(res["state"]["step"]) == 5 and saved == dataclasses.replace(tc, steps=5)
    capsys.readouterr()
    assert TT.main(["--out", str(out), "--resume", "--steps", "6", "--lr", "1e-3", *quiet]) == 2
    assert "configuration differs" in capsys.readouterr().err
    assert TT.main(["--out", str(out), "--resume", "--preset", "tiny_long", *quiet]) == 2
    assert "is a tiny_tasks run" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the MoE preset (issue #45)
TINY_MOE = dataclasses.replace(TINY, family="llada_moe", n_experts=4, top_k=2, mlp_hidden=16, aux_loss_coef=0.01,
                               tasks=("copy", "reverse"))


def test_moe_training_forward_is_the_familys_and_its_balance_loss_is_switchs():
    """The MoE run's training forward gives ``llada_moe.forward``'s hidden states, and its load-balancing loss
    and expert shares are ``E * sum_e f_e P_e`` recomputed in numpy from the family's own router diagnostic
    (``llada_moe.routing``) over the valid tokens alone (keys beyond them hidden); the loss reaches the router."""
    from polestar_jax.models import llada_moe as MOE

    tok = TT.load_tokenizer(TT.asset_model_dir(TT.TOKENIZER_SOURCE))
    mcfg = TT.model_config(TINY_MOE, tok)
    assert mcfg.family == "llada_moe" and (mcfg.moe.n_experts, mcfg.moe.top_k) == (4, 2)
    params = TT.init_params(dataclasses.replace(TINY_MOE, init_std=0.3), mcfg)
    ids = np.random.default_rng(0).integers(0, 256, (2, 20)).astype(np.int32)
    n = 14  # valid prefix of every row: its hidden states are a forward over ids[:, :n]
    valid = np.arange(20)[None].repeat(2, 0) < n
    pos = np.broadcast_to(np.arange(20, dtype=np.int32), (2, 20))
    # one compile for the training side (values and the router's gradient), one for the family's references
    (aux, (h, share)), g = jax.jit(jax.value_and_grad(lambda pr: (lambda o: (o[1], (o[0], o[2])))(
        TT.moe_forward(pr, ids, mcfg, pos, valid)), has_aux=True))(params)
    want, routed = jax.jit(lambda pr: (MOE.forward(pr, ids, mcfg, pos, pos, valid).h,
                                       MOE.routing(pr, ids[:, :n], mcfg)))(params)
    np.testing.assert_allclose(np.asarray(h), np.asarray(want), rtol=1e-5, atol=2e-5)  # (rounding)

    logits, idx, _ = (np.asarray(a) for a in routed)  # [N, 2n, E], [N, 2n, k]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    f = np.stack([np.bincount(i.ravel(), minlength=4) / i.size for i in idx])  # [N, E]
    ref = np.mean([4 * np.sum(fl * pl.mean(0)) for fl, pl in zip(f, p)])
    np.testing.assert_allclose(np.asarray(share), f, atol=1e-6)
    np.testing.assert_allclose(float(aux), ref, rtol=1e-5)
    assert (f > 0).sum(-1).min() > 1  # (a random router spreads the tokens: the check is not vacuous)
    assert float(jnp.abs(g["blocks"]["router"]).max()) > 0


def test_moe_preset_trains_and_validates(tmp_path):
    """A tiny MoE run: the loss falls, the balance loss is logged, and the option checks are one-line errors."""
    res = _run(TINY_MOE, tmp_path / "moe")
    losses = [res["losses"][s] for s in range(TINY_MOE.steps)]
    assert all(np.isfinite(losses)) and np.mean(losses[-6:]) < np.mean(losses[:4]) - 0.5, losses
    assert 1.0 <= res["meta"]["history"][-1]["balance_loss"] < 4.0  # E * sum f P lies in [1, E]
    assert "e_gate" in res["state"]["params"]["blocks"] and "w_gate" not in res["state"]["params"]["blocks"]
    tc = TT.preset_config("tiny_moe")
    assert tc.family == "llada_moe" and tc.aux_loss_coef > 0 and TT.TrainConfig.from_json(tc.to_json()) == tc
    tok = TT.load_tokenizer(TT.asset_model_dir(TT.TOKENIZER_SOURCE))
    for task in tc.tasks:  # every training task fits the layout
        for p, a in T.eval_instances(task, 50):
            assert len(TT.prompt_ids(tok, p)) <= tc.prompt_slot and len(a) < tc.gen_length
    for bad, match in [(dict(top_k=5), "top_k"), (dict(family="dense"), "family"),
                       (dict(aux_loss_coef=-1.0), "aux_loss_coef")]:
        with pytest.raises(TT.TrainError, match=match):
            dataclasses.replace(TINY_MOE, **bad)
    with pytest.raises(TT.TrainError, match="options of family llada_moe"):
        dataclasses.replace(TINY, n_experts=4)
