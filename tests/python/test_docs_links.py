"""The user docs stand on a clone alone: every relative link of the README, `docs/` and the
other READMEs names a file or folder in the repository (and a heading there, where it names
one), none leaves the repository, and the user docs carry none of the project's own
bookkeeping (its issue numbers or commit hashes; git history holds those)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

LINKED_DOCS = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "hooks" / "README.md",
    REPO / "models" / "README.md",
    REPO / "notebooks" / "README.md",
    REPO / "schemas" / "v2" / "README.md",
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def prose(path: Path) -> str:
    """The file without its fenced code blocks, where brackets are code, not links."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", prose(path), re.M)}


def relative_links(path: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(prose(path))
        if not re.match(r"[a-z]+:", target)  # http:, https:, mailto:
    ]


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_a_path_and_heading_in_the_clone(doc: Path) -> None:
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.is_relative_to(REPO.resolve()):
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO.resolve())}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_the_readme_links_into_docs() -> None:
    # Guards the check above against finding nothing to check.
    assert any(t.startswith("docs/") for t in relative_links(REPO / "README.md"))


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_user_docs_cite_no_issue_numbers_or_own_commits(doc: Path) -> None:
    text = doc.read_text()
    issues = re.findall(r"\bissues? \d+", text, re.I)
    assert not issues, f"{doc.relative_to(REPO)}: {issues}"
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return
    own = []
    for word in sorted(set(re.findall(r"\b[0-9a-f]{7,12}\b", text))):
        if not re.search(r"[a-f]", word) or not re.search(r"\d", word):
            continue  # a number, or a word
        found = subprocess.run(
            ["git", "-C", str(REPO), "cat-file", "-e", f"{word}^{{commit}}"],
            capture_output=True,
            check=False,
        )
        if found.returncode == 0:
            own.append(word)
    assert not own, f"{doc.relative_to(REPO)} cites this repository's commits: {own}"
