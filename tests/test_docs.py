"""The documentation is a map that holds: docs/README.md lists every page, and every relative
link in the README, benchmarks/README.md and docs/ points at a file that exists (and, for a
`#fragment` into a markdown page, at one of its headings, slugged as GitHub slugs them)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    """Every markdown page under docs/, except the run folders' files."""
    return sorted(p for p in DOCS.rglob("*.md") if "runs" not in p.relative_to(DOCS).parts)


def unfenced(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where a link is a link."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def slugs(page: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation but '-' and '_' dropped, spaces to '-',
    a repeated slug numbered from -1."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.*)$", unfenced(page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, -1) + 1
        seen[slug] = count
        if count:
            seen[f"{slug}-{count}"] = 0
    return set(seen)


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        found = (page.parent / path).resolve() if path else page
        if not found.exists() or (
            fragment and found.suffix == ".md" and fragment not in slugs(found)
        ):
            broken.append(target)
    return broken


def test_every_docs_page_is_listed_in_the_index():
    index = DOCS / "README.md"
    listed = {(DOCS / t.split("#")[0]).resolve() for t in links(index)}
    missing = [str(p.relative_to(DOCS)) for p in pages() if p != index and p not in listed]
    assert not missing, f"docs/README.md does not list {missing}"


@pytest.mark.parametrize(
    "page",
    [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *pages()],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_link_check_catches_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A `code` Title\n## A code title\n[ok](page.md#a-code-title-1) [gone](nope.md)\n"
        "[no heading](#b) [ok](#a-code-title) `[code](nope.md)`\n```\n[fenced](nope.md)\n```\n"
    )
    assert slugs(page) == {"a-code-title", "a-code-title-1"}
    assert broken_links(page) == ["nope.md", "#b"]
