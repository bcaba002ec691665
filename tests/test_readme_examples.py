"""The examples of README.md, docs/usage.md and docs/test-beds.md run, and give what the pages say they give.

The examples are read from the Markdown itself, so the pages and this test cannot drift apart:

* a ```` ```bash ```` block holds commands, one per line (``\\`` continues a line, ``&&`` chains commands).
  ``python -m polestar_jax.generate`` on a bundled model (no ``--model``, or one under
  ``polestar_jax/assets/``) is run in-process (``main()``, the command's own code path after parsing); a
  trailing ``# -> ANSWER`` comment is the answer it must print (its first line, or the ``text`` of its
  ``--json`` line). Commands for real checkpoints (``--model /models/...``) and ``python -m
  polestar_jax.convert`` / ``eval`` only have their flags parsed by the command's own argument parser
  (no checkpoint or GPU is available here); ``crosscheck`` folders must exist; ``pip install`` and
  ``python -m pytest`` are not run. Any other command fails the test: teach it here first.
* a ```` ```python ```` block is executed as written.
* a ```` ```text ```` block right after a code block is what that block prints (its one command that runs,
  or the Python block), line for line; timings (``tokens/s``, ``decode=``, ``compile``) may differ. An
  expected output that starts with ``error:`` means exit status 2 and that text on stderr.
* blocks without a language (trees, training logs) are not run, and must not hold a ``python -m
  polestar_jax`` command.

Cost: every bundled command uses one of a few shapes (prompts of at most 48 tokens at batch 1; the
snippet's batch of 4 at slot 64, which tests/test_api.py and tests/test_options.py compile too), so the
file compiles about two Polestar block programs and a few small Fast-dLLM / LLaDA ones.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shlex
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
#: The pages whose examples must run as shown.
PAGES = ("README.md", "docs/usage.md", "docs/test-beds.md")
#: Model folders that ship with the package (anything else is a real checkpoint: flags only).
BUNDLED_PREFIX = "polestar_jax/assets/"
_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)\s*$")
_ANSWER = re.compile(r"#\s*->\s*(\S.*?)\s*$")
#: Timings in printed output: replaced by '#' on both sides before comparing.
_VOLATILE = ((re.compile(r"(tokens/s=|decode=|compile=)[0-9.]+"), r"\1#"),
             (re.compile(r"[0-9][0-9.,]*( tokens/s)"), r"#\1"),
             (re.compile(r"(compile |programs? in )[0-9.]+"), r"\1#"),
             # what the compile seconds were depends on the compilation cache's state
             (re.compile(r" \(tracing and lowering [^)]*\)"), ""))


@dataclasses.dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str


@dataclasses.dataclass
class Example:
    """One runnable thing of a page: a command (``argv``) or a Python block (``code``)."""

    page: str
    line: int
    argv: Optional[list] = None
    code: Optional[str] = None
    answer: Optional[str] = None  # the `# -> ANSWER` of a command
    output: Optional[str] = None  # the ```text block that follows

    @property
    def id(self) -> str:
        if self.argv is None:
            return f"{self.page}:{self.line}:python"
        what = self.argv[2] if self.argv[:2] == ["python", "-m"] and len(self.argv) > 2 else self.argv[0]
        if "--prompt" in self.argv[:-1]:
            what += " " + self.argv[self.argv.index("--prompt") + 1]
        return f"{self.page}:{self.line}:{what}"


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of a Markdown page, in order (fences start a line)."""
    out, cur = [], None
    for no, line in enumerate((REPO / page).read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if cur is None:
            if m:
                cur = (no, m.group(1), m.group(2).lower(), [])
        elif m and m.group(1)[0] == cur[1][0] and len(m.group(1)) >= len(cur[1]) and not m.group(2):
            out.append(Block(page, cur[0], cur[2], "\n".join(cur[3])))
            cur = None
        else:
            cur[3].append(line)
    assert cur is None, f"{page}:{cur[0]}: unclosed code block"
    return out


def commands(block: Block) -> list[tuple[int, list, Optional[str]]]:
    """(line, argv, answer) of every command of a bash block: continuation lines joined, ``&&`` split,
    leading ``VAR=value`` words dropped, comments removed (``# -> ANSWER`` kept as the answer)."""
    out, buf, start = [], "", None
    for i, line in enumerate(block.text.splitlines()):
        start = i if start is None else start
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        m = _ANSWER.search(buf)
        words = shlex.split(buf, comments=True)
        parts, cur = [], []
        for w in words + ["&&"]:
            if w == "&&":
                parts.append(cur)
                cur = []
            else:
                cur.append(w)
        for argv in parts:
            while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
                argv = argv[1:]
            if argv:
                out.append((block.line + 1 + start, argv, m.group(1) if m else None))
        buf, start = "", None
    return out


def is_run(argv: list) -> bool:
    """True for the commands this test runs: ``generate`` on a bundled model."""
    if argv[:3] != ["python", "-m", "polestar_jax.generate"]:
        return False
    model = next((argv[i + 1] for i, w in enumerate(argv[:-1]) if w == "--model"), None)
    return model is None or model.startswith(BUNDLED_PREFIX)


def examples(page: str) -> list[Example]:
    out: list[Example] = []
    last: list[Example] = []  # the run examples of the previous code block
    for b in blocks(page):
        if b.lang == "bash":
            last = []
            for line, argv, answer in commands(b):
                ex = Example(page, line, argv=argv, answer=answer)
                out.append(ex)
                if is_run(argv):
                    last.append(ex)
        elif b.lang == "python":
            ex = Example(page, b.line, code=b.text)
            out.append(ex)
            last = [ex]
        elif b.lang == "text":
            assert len(last) == 1, (f"{page}:{b.line}: a text block must follow a code block that runs exactly "
                                    f"one command or Python snippet (found {len(last)})")
            last[0].output = b.text
            last = []
        else:
            assert "python -m polestar_jax" not in b.text, (
                f"{page}:{b.line}: a command in a block without a language is never checked; mark it ```bash")
            last = []
    return out


EXAMPLES = [ex for page in PAGES for ex in examples(page)]


def _mask(text: str) -> list[str]:
    lines = []
    for line in text.strip("\n").splitlines():
        for rx, sub in _VOLATILE:
            line = rx.sub(sub, line)
        lines.append(line.rstrip())
    return lines


def _check_output(ex: Example, out: str, err: str, code: int) -> None:
    if ex.output is None:
        return
    if ex.output.lstrip().startswith("error:"):
        assert code == 2, (code, out, err)
        assert _mask(err) == _mask(ex.output), f"{ex.id}: stderr differs from the page"
    else:
        assert code == 0, (code, out, err)
        assert _mask(out) == _mask(ex.output), f"{ex.id}: output differs from the page:\n{out}"


def _check_answer(ex: Example, out: str) -> None:
    if ex.answer is None:
        return
    lines = out.splitlines()
    if "--json" in ex.argv:  # stdout is one JSON document (the text went to stderr)
        assert len(lines) == 1 and json.loads(lines[0])["text"] == ex.answer, f"{ex.id}: answered {lines}"
        return
    assert lines and lines[0] == ex.answer, f"{ex.id}: answered {lines[:1]}, the page says {ex.answer!r}"


def _run_generate(argv: list, capsys) -> tuple[int, str, str]:
    from polestar_jax import generate as gen_cli

    try:
        code = gen_cli.main(argv)
    except SystemExit as e:  # argparse errors exit from inside main()
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _parse_only(ex: Example) -> None:
    """A command that cannot run here (a real checkpoint): its flags must parse."""
    module, args = ex.argv[2], ex.argv[3:]
    if module == "polestar_jax.generate":
        from polestar_jax import generate as gen_cli

        parsed = gen_cli.build_parser().parse_args(args)
        gen_cli.decode_config_from_args(parsed, {})  # flags that would have no effect are refused here
    elif module == "polestar_jax.eval":
        from polestar_jax import eval as eval_cli

        eval_cli.build_parser().parse_args(args)
    elif module == "polestar_jax.convert":
        from polestar_jax.convert.__main__ import build_parser

        build_parser().parse_args(args)
    elif module == "polestar_jax.serve":  # a server runs until stopped: tests/test_serve.py starts one
        from polestar_jax import serve

        serve.build_parser().parse_args(args)
    elif module == "polestar_jax.crosscheck":
        folders = [a for a in args if not a.startswith("-")]
        assert folders and all((REPO / f).is_dir() for f in folders), ex.id
    else:
        raise AssertionError(f"{ex.id}: this test does not know how to check `python -m {module}`")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, offline_session_cache):
    """Relative paths of the pages resolve from the repository root; the session's compile cache."""
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda ex: ex.id)
def test_example(ex: Example, capsys):
    if ex.code is not None:
        with contextlib.redirect_stdout(io.StringIO()) as buf:
            exec(compile(ex.code, f"{ex.page}:{ex.line}", "exec"), {})  # noqa: S102 - the page's own example
        _check_output(ex, buf.getvalue(), "", 0)
        return
    argv = ex.argv
    if argv[0] == "pip" or argv[:3] == ["python", "-m", "pytest"]:
        assert ex.answer is None and ex.output is None
        return
    assert argv[:2] == ["python", "-m"], f"{ex.id}: this test does not know how to check this command"
    if not is_run(argv):
        assert ex.answer is None and ex.output is None, f"{ex.id}: promises an answer that is never checked"
        _parse_only(ex)
        return
    code, out, err = _run_generate(argv[3:], capsys)
    _check_output(ex, out, err, code)
    if ex.answer is not None:
        assert code == 0, (code, out, err)
        _check_answer(ex, out)


def test_the_pages_have_their_examples():
    """The parser finds what the pages are known to hold (a guard against a parser that finds nothing)."""
    readme = [ex for ex in EXAMPLES if ex.page == "README.md"]
    first = readme[0]
    assert first.argv == ["pip", "install", "-e", "."]
    assert readme[1].argv[:3] == ["python", "-m", "polestar_jax.generate"] and readme[1].output
    assert any(ex.code and "load()" in ex.code and ex.output for ex in readme)
    assert sum(1 for ex in EXAMPLES if ex.answer) >= 5
    assert any(ex.argv and "/models/" in " ".join(ex.argv) for ex in readme)
