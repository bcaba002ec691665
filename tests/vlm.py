"""A tiny random LLaDA-V model folder for the user-path tests (API, CLI, server, convert): the golden
folder's tower and LLaDA-V keys, a 2-layer LM over the bundled ``tiny_tasks`` tokenizer (264 ids, its
LLaDA chat template), random weights from :func:`polestar_jax.models.llada_v.init_params`, written as an HF
folder (``model.safetensors`` with the real checkpoint's tensor names)."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "llada_v_tiny_a"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tiny_llada_v_config():
    from polestar_jax.config import ModelConfig
    from polestar_jax.io.tokenizer import bundled_model_dir

    golden = ModelConfig.from_json(str(GOLDEN))
    text = ModelConfig.from_json(bundled_model_dir())
    return dataclasses.replace(golden, vocab_size=text.vocab_size, embedding_size=text.embedding_size,
                               mask_token_id=text.mask_token_id, eos_token_id=text.eos_token_id,
                               pad_token_id=text.pad_token_id)


def make_tiny_llada_v(folder: Path, seed: int = 0) -> Path:
    """Writes the tiny LLaDA-V HF folder into ``folder`` (created) and returns it."""
    from polestar_jax.io.checkpoint import export_hf
    from polestar_jax.io.tokenizer import bundled_model_dir
    from polestar_jax.models import llada_v

    cfg = tiny_llada_v_config()
    params = llada_v.init_params(cfg, jax.random.PRNGKey(seed), std=0.5)
    folder.mkdir(parents=True, exist_ok=True)
    export_hf(folder, cfg, jax.tree.map(lambda a: jax.numpy.asarray(a), params))
    for name in TOKENIZER_FILES:
        shutil.copy(Path(bundled_model_dir()) / name, folder / name)
    return folder
