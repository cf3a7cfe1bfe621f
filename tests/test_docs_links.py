"""Every relative link in the repository's Markdown resolves: the file exists and, where the link
names a section (``file.md#section``), the file has a heading with that anchor (GitHub's rule:
lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` ... for repeats)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    # scratch output (runs/) and build trees are not part of the repository's documents
    skip = {"runs", "build", ".git", ".eggs"}
    return sorted(p for p in ROOT.rglob("*.md")
                  if not skip.intersection(p.relative_to(ROOT).parts) and "egg-info" not in str(p))


def github_anchor(heading: str) -> str:
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if fenced or not heading:
            continue
        anchor = github_anchor(heading.group(1))
        repeat = seen.get(anchor, 0)
        seen[anchor] = repeat + 1
        found.add(anchor if repeat == 0 else f"{anchor}-{repeat}")
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part) if file_part else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no such section)")
    return broken


def test_the_anchor_rule_matches_github():
    # the headings' forms the documents use: code spans, ×, ±, commas, dots, repeats
    assert github_anchor("The whitened step in `Gram` form") == "the-whitened-step-in-gram-form"
    assert github_anchor("d_model 256: 1.2x ± 0.03, 3 seeds") == "d_model-256-12x--003-3-seeds"


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Part one\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md#part-one) [gone](missing.md) [bad](a.md#part-two) [web](https://x.org/y)\n")
    assert broken_links(doc) == ["missing.md (no such file)", "a.md#part-two (no such section)"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert not broken_links(path), f"{path.relative_to(ROOT)}: broken links {broken_links(path)}"
