"""docs/configuration.md cannot drift: it is what ``docs/make_configuration.py`` writes from the config
dataclasses' own metadata (the text ``--help`` prints), and every field has something to say."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Optional

from polestar_jax.config import Cache, Decoder, knob

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "docs" / "make_configuration.py"


def _script():
    if "make_configuration" in sys.modules:
        return sys.modules["make_configuration"]
    spec = importlib.util.spec_from_file_location("make_configuration", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_configuration"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_configuration_page_is_current():
    mc = _script()
    page = mc.PAGE
    assert page.exists(), f"{page.relative_to(REPO)} is missing: run `{mc.COMMAND}`"
    assert page.read_text(encoding="utf-8") == mc.render(), (
        f"{page.relative_to(REPO)} differs from what the config dataclasses say: regenerate it with "
        f"`{mc.COMMAND}` (and commit the result)")


def test_every_field_is_described():
    """A field with neither a ``knob`` help text nor a ``#`` comment above it would be a blank row."""
    assert _script().undocumented() == [], (
        "give these fields a knob(..., help) or a '#' comment above them in polestar_jax/config.py")


def test_page_covers_every_field_and_flag():
    from polestar_jax import cli
    from polestar_jax.config import DecodeConfig, PolestarConfig

    text = _script().render()
    for cls in (DecodeConfig, PolestarConfig):
        assert f"## {cls.__name__}" in text
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f.name
            if "help" in f.metadata:
                assert f"`{cli.flag_of(cls, f.name, False)}`" in text, f.name


@dataclasses.dataclass(frozen=True)
class _Later:
    """A config a later change adds (module level: its annotations are strings, resolved here)."""

    mode: Decoder = knob(Decoder.polestar, "which decoder")
    cache: Optional[Cache] = knob(None, "which cache", cli_default=Cache.dual)
    count: int = knob(3, "how many", flag="--n", aliases=("--count",))
    # an API-only field
    plain: str = "x"


def test_enum_fields_and_new_fields_render():
    """A field typed by a str-enum mode (its default a member, no ``choices``) and a new field render."""
    section = _script().class_section(_Later, {}, {})
    assert "| `mode` | `--mode` | `'polestar'` | `llada`, `fastdllm`, `polestar`, `polestar_v` | which decoder |" in section
    assert "`None`; command line and `polestar_jax.api`: `dual`" in section
    assert "`none`, `prefix`, `dual`" in section
    assert "| `count` | `--n` (also `--count`) | `3` |" in section
    assert "| `plain` | (API / model_args only) | `'x'` |  | an API-only field |" in section


def test_page_lists_every_flag_of_the_commands():
    """Every flag of ``generate``, ``serve`` and ``eval`` is on the page: the decoding options in their
    config's section, the others under Run options (--batch, --dry-run, --dtype, --max-tokens, ...)."""
    mc = _script()
    text = mc.render()
    run = text.split("## Run options", 1)[1]
    for module in mc.COMMANDS:
        section = run.split(f"### `python -m {module}`", 1)[1].split("###", 1)[0]
        for a in mc._parser_of(module)._actions:
            if a.help == "==SUPPRESS==" or a.dest == "help" or not a.option_strings:
                continue
            assert any(f"`{o}`" in text for o in a.option_strings), (module, a.option_strings)
            if not any(f"`{o}`" in text.split("## Run options", 1)[0] for o in a.option_strings):
                assert f"`{a.option_strings[0]}`" in section, (module, a.option_strings)
    for flag in ("--batch", "--batch-size", "--coordinator", "--dry-run", "--dtype", "--json", "--precompile"):
        assert f"| `{flag}`" in run.split("### `python -m polestar_jax.serve`")[0], flag
