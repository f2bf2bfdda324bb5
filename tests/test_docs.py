"""The project documents itself: README.md and docs/ stand alone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)")


def test_the_architecture_is_documented_in_the_repository() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    for topic in ("## Layers", "## States", "## The evidence funnel", "## Transactions"):
        assert topic in text
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()


def test_no_document_points_outside_the_repository() -> None:
    for doc in DOCS:
        text = doc.read_text()
        assert "../shared" not in text, f"{doc.name} points at ../shared"
        for target in LINK.findall(text):
            if "://" in target:
                continue  # a web page, not a path
            resolved = (doc.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{doc.name} links outside: {target}"
            assert resolved.exists(), f"{doc.name} links to a missing {target}"
