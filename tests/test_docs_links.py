"""Links hold: every relative link and ``#anchor`` of the repository's Markdown pages resolves, and every
docs page (and anchor) a docstring or comment cites exists. Pure text, no import of the package.

* Markdown: every ``*.md`` of the repository (README.md, docs/, bench/, the bundled assets' READMEs, ...;
  not ``tests/data`` and hidden folders). Each inline link or image ``[text](target)`` and reference
  definition ``[label]: target`` that is not a URL (``http:``, ``mailto:``, ...) must name an existing file
  or folder, relative to the page; a ``#anchor`` into a Markdown page (the same page for ``(#anchor)``)
  must be one of that page's anchors: a heading's GitHub slug (lowercase, punctuation other than ``-`` and
  ``_`` dropped, each space a ``-``, the n-th repeat of a slug suffixed ``-n``) or an explicit
  ``<a id="...">`` / ``<a name="...">``. Code blocks and code spans are not links.
* Python: every ``docs/<page>.md`` or ``<page>.md#anchor`` cited in ``polestar_jax/``, ``kernels/``,
  ``convert/``, ``bench/`` and ``tests/`` names an existing page (``docs/`` first, then relative to the
  file, then the repository root) and, with an anchor, an anchor of that page.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Folders (relative to the repository) whose files are not checked.
SKIP_DIRS = {"tests/data"}
#: Folders whose Python files may cite docs pages.
CODE_DIRS = ("polestar_jax", "kernels", "convert", "bench", "tests")

_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_ATX = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")
_HTML_ANCHOR = re.compile(r"""<a\s[^>]*?\b(?:id|name)\s*=\s*["']?([^"'\s>]+)""", re.I)
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_CITATION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md)(#[\w-]+)?")


def _skipped(rel: str) -> bool:
    parts = rel.split("/")
    return any(p.startswith(".") or p.endswith(".egg-info") or p in ("__pycache__", "node_modules")
               for p in parts) or any(rel == d or rel.startswith(d + "/") for d in SKIP_DIRS)


def _files(suffix: str, roots: tuple[str, ...] = ("",)) -> list[Path]:
    out = []
    for root in roots:
        base = REPO / root
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            rel_dir = Path(dirpath).relative_to(REPO).as_posix()
            dirnames[:] = sorted(d for d in dirnames if not _skipped(f"{rel_dir}/{d}".lstrip("./")))
            if rel_dir != "." and _skipped(rel_dir):
                continue
            out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffix)]
    return sorted(set(out))


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fence: Optional[str] = None
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
                continue
            if m.group(1) == fence:
                fence = None
                continue
        if fence is None:
            yield no, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before duplicates are numbered)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = _CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"\1", text)  # _emphasis_
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    """Every anchor of the Markdown page ``path``: heading slugs (repeats numbered) and explicit ones."""
    seen: dict[str, int] = {}
    out: set[str] = set()

    def add(heading: str) -> None:
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")

    prev = ""
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        out.update(_HTML_ANCHOR.findall(line))
        m = _ATX.match(line)
        if m:
            add(m.group(2))
        elif _SETEXT.match(line) and prev.strip() and not re.match(r"^\s*([-*+>|]|\d+[.)]\s|#)", prev):
            add(prev.strip())
            line = ""
        prev = line
    return frozenset(out)


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of every link of the Markdown page ``path`` (not in code)."""
    for no, line in _prose_lines(path.read_text(encoding="utf-8")):
        line = _CODE_SPAN.sub("", line)
        targets = [m.group(1) for m in _INLINE_LINK.finditer(line)]
        ref = _REF_DEF.match(line)
        if ref:
            targets.append(ref.group(1))
        for t in targets:
            yield no, t.strip("<>")


def check_target(page: Path, target: str, base: Path) -> Optional[str]:
    """Why ``target`` (a link or citation found in ``page``, relative to the folder ``base``) does not
    resolve; None when it does or is not a local link."""
    if _SCHEME.match(target) or target.startswith("//"):
        return None
    path_part, _, anchor = target.partition("#")
    path_part = unquote(path_part.split("?", 1)[0])
    dest = page if not path_part else (REPO / path_part.lstrip("/") if path_part.startswith("/")
                                       else base / path_part)
    if not dest.exists():
        return f"{path_part}: no such file"
    if anchor and dest.is_file() and dest.suffix == ".md" and unquote(anchor) not in anchors(dest.resolve()):
        return f"#{anchor}: no such anchor in {_rel(dest)}"
    return None


def _rel(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def broken_links(page: Path) -> list[str]:
    out = []
    for no, target in links(page):
        why = check_target(page, target, page.parent)
        if why:
            out.append(f"{_rel(page)}:{no}: ({target}) {why}")
    return out


def _citation_page(py: Path, name: str) -> Optional[Path]:
    for base in ((REPO / "docs") if "/" not in name else None, py.parent, REPO):
        if base is not None and (base / name).is_file():
            return base / name
    return None


def broken_citations(py: Path) -> list[str]:
    """Docs pages and anchors cited by the Python file ``py`` that do not exist: ``docs/<page>.md`` with or
    without an anchor, any other ``<page>.md#anchor``."""
    out = []
    for no, line in enumerate(py.read_text(encoding="utf-8").splitlines(), 1):
        for m in _CITATION.finditer(line):
            name, anchor = m.group(1), (m.group(2) or "")[1:]
            if not anchor and not name.startswith("docs/"):
                continue  # a file name in prose (README.md, results.md written by a run): not a citation
            page = _citation_page(py, name)
            where = f"{_rel(py)}:{no}: {name}{'#' + anchor if anchor else ''}"
            if page is None:
                out.append(f"{where}: no such page")
            elif anchor and anchor not in anchors(page.resolve()):
                out.append(f"{where}: no such anchor in {_rel(page)}")
    return out


MARKDOWN = _files(".md")
PYTHON = _files(".py", CODE_DIRS)


def test_pages_found():
    names = {p.relative_to(REPO).as_posix() for p in MARKDOWN}
    assert {"README.md", "bench/README.md", "docs/algorithm.md", "docs/differences.md"} <= names
    assert not any(n.startswith("tests/data/") for n in names)
    assert any(p.name == "config.py" for p in PYTHON)


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: p.relative_to(REPO).as_posix())
def test_markdown_links_resolve(page):
    broken = broken_links(page)
    assert not broken, "broken links (fix the link or the heading it points at):\n" + "\n".join(broken)


def test_docstring_citations_resolve():
    broken = [b for py in PYTHON for b in broken_citations(py)]
    assert not broken, "docs citations in the code that do not resolve:\n" + "\n".join(broken)


def test_slugs_and_anchors(tmp_path):
    """The slug rule on headings like ours, duplicates, explicit anchors, code blocks and setext headings."""
    assert slug("D1 [J1] The mask token is never committed; every loop is bounded") == \
        "d1-j1-the-mask-token-is-never-committed-every-loop-is-bounded"
    assert slug("Batches, sharding, memory planning") == "batches-sharding-memory-planning"
    assert slug("The long-answer test bed (`tiny_long`: trained, benchmarked)") == \
        "the-long-answer-test-bed-tiny_long-trained-benchmarked"
    assert slug("A & B") == "a--b"
    assert slug("See [the page](other.md) now") == "see-the-page-now"
    page = tmp_path / "p.md"
    page.write_text("# Intro\n\n## Intro\n\nSetext\n------\n\n<a id=\"d9\"></a>\n```\n# not a heading\n```\n"
                    "[ok](#intro-1) [ok](#setext) [ok](#d9) `[code](#nowhere)`\n[bad](#intro-2) [bad](q.md)\n",
                    encoding="utf-8")
    assert anchors(page) == {"intro", "intro-1", "setext", "d9"}
    found = [t for _, t in links(page)]
    assert found == ["#intro-1", "#setext", "#d9", "#intro-2", "q.md"]
    assert [check_target(page, t, tmp_path) is None for t in found] == [True, True, True, False, False]
