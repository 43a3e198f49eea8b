"""The user's docs read as a reference: no page under docs/ and not the README names an issue
number (the history of measurements, with its issues, is bench/HISTORY.md); and every pointer
to a doc's section, a Markdown link's anchor or a quoted title after a doc's path, anywhere in
the project, names a section that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# "issue 25", "Issues 9 and 25", "#25": how a page would name an issue of the project's tracker.
ISSUE = re.compile(r"\bissues?\s+#?\d+|(?<![\w&/#])#\d+\b", re.IGNORECASE)
# `docs/operations.md`, "Sizing" / docs/performance.md "Key count": a section named by its title.
QUOTED = re.compile(r"`?((?:[\w-]+/)*\w+\.md)`?,?\s+(?:section \d+, )?\"([^\"]+)\"")
LINK = re.compile(r"\]\(((?:[\w./-]+)?\.md)?#([\w-]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)
BOLD = re.compile(r"^(?:\| )?\*\*([^*]+)\*\*", re.MULTILINE)
SOURCES = ("README.md", "docs", "bench", "app", "tests", "migrations", "deploy", "lab")


def headings(page: Path) -> list[str]:
    """A page's section titles, without a number in front or Markdown's backticks, and the bold
    words that open a paragraph or a table row (a place a pointer may name too)."""
    text = page.read_text()
    return [
        re.sub(r"^\d+\.\s+", "", title.replace("`", "")).strip()
        for title in HEADING.findall(text) + BOLD.findall(text)
    ]


def anchor(title: str) -> str:
    """The anchor GitHub makes of a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def project_files() -> list[Path]:
    files: list[Path] = []
    for name in SOURCES:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [
                p
                for p in sorted(path.rglob("*"))
                if p.suffix in {".md", ".py", ".yml", ".yaml", ".sql", ".toml"}
                and ".venv" not in p.parts
            ]
    return files


def test_no_user_doc_names_an_issue_number() -> None:
    found = [
        f"{page.relative_to(ROOT)}: {match.group(0)!r}"
        for page in USER_DOCS
        for match in ISSUE.finditer(page.read_text())
    ]
    assert not found, found


def test_the_issue_pattern_finds_what_a_page_would_write() -> None:
    for text in ("issue 25", "Issue 25, sixth pass", "issues 9 and 25", "(#25)", "see #7."):
        assert ISSUE.search(text), text
    for text in ("a 25-row batch", "`operations.md#1-running-it`", "&#39;", "C#9"):
        assert not ISSUE.search(text), text


def test_every_quoted_section_title_exists() -> None:
    missing = []
    for path in project_files():
        text = path.read_text()
        for match in QUOTED.finditer(text):
            target = match.group(1)
            title = re.sub(r"\s*\n\s*#?\s*", " ", match.group(2)).replace("`", "")
            page = ROOT / target if "/" in target else path.parent / target
            if not page.exists() and not target.startswith("docs/"):
                page = ROOT / "docs" / target
            if not page.exists():
                continue  # a quoted phrase after some other file's name
            titles = headings(page)
            if not any(t == title or t.startswith(title) for t in titles):
                missing.append(f"{path.relative_to(ROOT)}: {target} {title!r}")
    assert not missing, missing


def test_every_markdown_anchor_exists() -> None:
    missing = []
    for path in project_files():
        if path.suffix != ".md":
            continue
        for match in LINK.finditer(path.read_text()):
            target = path.parent / match.group(1) if match.group(1) else path
            if not target.exists():
                missing.append(f"{path.relative_to(ROOT)}: {match.group(0)} (no such file)")
            elif match.group(2) not in {anchor(t) for t in HEADING.findall(target.read_text())}:
                missing.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not missing, missing
