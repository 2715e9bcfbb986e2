"""The documentation's links resolve: every relative link and image in README.md and
docs/*.md names a file of the repository, and every `#anchor` names a heading of the file it
points into, with the anchors GitHub generates; the repository paths they name in inline code
exist, and so do the sections that code comments name. The README also carries the two set-up commands and the test command CI runs."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code removed."""
    fence = False
    for number, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield number, re.sub(r"`[^`]*`", "", line)


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, links reduced to their text, characters
    other than word characters, hyphens and spaces dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.replace("`", ""))
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (a repeated heading gets -1, -2, ...)."""
    seen: Counter[str] = Counter()
    out = set()
    fence = False
    for line in path.read_text().split("\n"):
        if line.startswith("```"):
            fence = not fence
        match = None if fence else re.match(r"#{1,6} +(.*?)\s*#*\s*$", line)
        if match:
            base = github_anchor(match.group(1))
            out.add(f"{base}-{seen[base]}" if seen[base] else base)
            seen[base] += 1
    return out


def links(path: Path) -> list[tuple[int, str]]:
    return [
        (number, m.group(1))
        for number, line in prose_lines(path.read_text())
        for m in LINK.finditer(line)
        if not re.match(r"[a-z][a-z0-9+.-]*:", m.group(1))  # http:, https:, mailto:
    ]


def broken_links(path: Path) -> list[str]:
    out = []
    for number, url in links(path):
        target, _, fragment = url.partition("#")
        file = (path.parent / target).resolve() if target else path
        where = f"{path.relative_to(ROOT)}:{number}: {url}"
        if not file.exists() or ROOT not in file.parents:
            out.append(f"{where}: no such file in the repository")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            out.append(f"{where}: no heading with this anchor in {file.relative_to(ROOT)}")
    return out


def test_anchor_rules_match_github():
    assert github_anchor("Qwen2.5-Coder's k-quants from their codes (eleventh session)") == (
        "qwen25-coders-k-quants-from-their-codes-eleventh-session"
    )
    assert github_anchor("Back on AVX2; the head next to `n-gram` on Zen 4") == (
        "back-on-avx2-the-head-next-to-n-gram-on-zen-4"
    )


def test_repeated_headings_get_numbered_anchors(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("# A\n\n## Notes\n\n```\n## Not a heading\n```\n\n## Notes\n")
    assert anchors(doc) == {"a", "notes", "notes-1"}


def test_broken_links_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Other\n\n## Part two\n")
    doc = tmp_path / "d.md"
    doc.write_text(
        "# Doc\n\n[ok](#doc) [ok](other.md#part-two) [web](https://example.org/x#y)\n"
        "`[code](missing.md)`\n\n```\n[fenced](missing.md)\n```\n"
        "[bad](other.md#part-three) [gone](missing.md) [self](#nowhere)\n"
    )
    assert [b.split(": ", 1)[1] for b in broken_links(doc)] == [
        "other.md#part-three: no heading with this anchor in other.md",
        "missing.md: no such file in the repository",
        "#nowhere: no heading with this anchor in d.md",
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc):
    assert links(doc), f"{doc} has no links: is the parser reading it?"
    assert broken_links(doc) == []


# a repository path in inline code: `specdec/models/load.py`, `tests/test_cli.py::test_x`
CODE_PATH = re.compile(r"`((?:specdec|benchmarks|tests|experiments|configs|docs)/[^`\s<>*{}]+)`")
# what the benchmarks write by default (benchmarks/results/<name>.json): not committed
OUTPUT = re.compile(r"benchmarks/results/[\w-]+\.(json|csv)$")


def missing_code_paths(path: Path) -> list[str]:
    out = []
    for number, line in enumerate(path.read_text().split("\n"), 1):
        for match in CODE_PATH.finditer(line):
            name = match.group(1).split("::")[0].rstrip(":,.")
            if not (ROOT / name).exists() and not OUTPUT.match(name):
                out.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_paths_exist(doc):
    """Files and folders the docs name in inline code exist (a rename leaves none behind)."""
    assert missing_code_paths(doc) == []


def test_missing_code_paths_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "specdec").mkdir()
    (tmp_path / "specdec" / "a.py").write_text("")
    doc = tmp_path / "d.md"
    doc.write_text(
        "`specdec/a.py` `specdec/a.py::test_x`, `benchmarks/results/bench_x.json`\n"
        "`specdec/b.py` and `tests/<name>.py`\n"
    )
    assert missing_code_paths(doc) == ["d.md:2: specdec/b.py"]


# a section named in a comment or docstring: README "CPU backend", docs/results.md, "Test
# suite runs" (a quote may run over a comment's line break)
SECTION_REF = re.compile(r'(README|docs/\w+\.md),? "([^"]+)"')
SOURCES = ["specdec", "benchmarks", "experiments", "configs", "tests", "Makefile", "pyproject.toml"]


def headings(path: Path) -> list[str]:
    return [
        re.sub(r"\s*#*\s*$", "", line.lstrip("#").strip())
        for _, line in prose_lines(path.read_text())
        if re.match(r"#{1,6} ", line)
    ]


def section_refs(text: str):
    """(file, section) of every named reference, comment markers between its lines removed."""
    flat = re.sub(r"\n\s*(#|//|\*)?\s*", " ", text)
    for match in SECTION_REF.finditer(flat):
        doc = "README.md" if match.group(1) == "README" else match.group(1)
        yield doc, match.group(2)


def names_a_heading(section: str, names: list[str]) -> bool:
    """The heading itself, or the heading without its parenthesised or colon-led tail."""
    return any(h == section or h.startswith((f"{section} (", f"{section}: ")) for h in names)


def stale_section_refs() -> list[str]:
    files = []
    for name in SOURCES:
        path = ROOT / name
        files += (
            [path] if path.is_file() else sorted(path.rglob("*.py")) + sorted(path.rglob("*.yaml"))
        )
    out = []
    for file in files:
        if file.name == "test_docs.py":
            continue
        for doc, section in section_refs(file.read_text()):
            if not (ROOT / doc).exists() or not names_a_heading(section, headings(ROOT / doc)):
                out.append(f'{file.relative_to(ROOT)}: {doc} "{section}"')
    return out


def test_code_names_existing_sections():
    """Comments and docstrings that send the reader to a section of the docs name one that
    exists (configs/config.yaml pointed at a README "Token trees" heading that had gone)."""
    assert stale_section_refs() == []


def test_section_refs_are_read_across_comment_lines():
    text = '# see README "Drafting from\n# earlier outputs"; docs/gpu.md, "End-to-end tables"'
    assert list(section_refs(text)) == [
        ("README.md", "Drafting from earlier outputs"),
        ("docs/gpu.md", "End-to-end tables"),
    ]
    names = ["Trained draft heads", "Drafting from earlier outputs (output cache)"]
    assert names_a_heading("Drafting from earlier outputs", names)
    assert not names_a_heading("Trained draft head", names)


def test_docs_are_linked_from_the_readme():
    linked = {
        (ROOT / url.partition("#")[0]).resolve() for _, url in links(ROOT / "README.md") if url
    }
    assert {p.resolve() for p in DOCS[1:]} <= linked


def test_readme_carries_the_setup_and_ci_commands():
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
