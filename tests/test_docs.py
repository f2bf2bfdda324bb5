"""The project documents itself: README.md and docs/ stand alone."""

from __future__ import annotations

import re
from pathlib import Path

from intentledger.api.webhook_routes import PROVIDER_WEBHOOKS
from intentledger.providers.stripe import PAYMENT_INTENT_EVENTS, REFUND_EVENTS

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


def section(doc: Path, heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level."""
    text = doc.read_text()
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    end = re.search(rf"^#{{1,{len(level)}}} ", text[start:], re.M)
    return text[start : start + end.start()] if end else text[start:]


def test_the_stripe_webhook_section_lists_every_event_the_adapter_reads() -> None:
    webhooks = section(ROOT / "docs" / "providers.md", "### Webhooks")
    listed = set(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", webhooks, re.M))
    assert listed == PAYMENT_INTENT_EVENTS | REFUND_EVENTS
    (subscribed,) = re.findall(r"--events (\S+)", webhooks)
    assert set(subscribed.split(",")) == PAYMENT_INTENT_EVENTS | REFUND_EVENTS
    assert f"--forward-to http://127.0.0.1:8000{PROVIDER_WEBHOOKS}stripe " in webhooks


SOURCES = [
    *(path for tree in ("src", "tests", "tools") for path in sorted((ROOT / tree).rglob("*.py")))
]


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, no punctuation, hyphens for spaces."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_cited_design_rule_has_its_heading() -> None:
    design = ROOT / "docs" / "design.md"
    anchors = {anchor(h) for h in re.findall(r"^#+ (.+)$", design.read_text(), re.M)}
    cited = {
        (path.name, target)
        for path in [*SOURCES, *DOCS]
        for target in re.findall(r"design\.md#([\w-]+)", path.read_text())
    }
    own_links = re.findall(r"\]\(#([\w-]+)\)", design.read_text())
    cited |= {("design.md", target) for target in own_links}
    missing = sorted((name, target) for name, target in cited if target not in anchors)
    assert not missing, f"cited rules with no heading in docs/design.md: {missing}"


def test_every_decision_the_code_cites_is_written_down() -> None:
    decisions = (ROOT / "docs" / "decisions").glob("[0-9][0-9][0-9][0-9]-*.md")
    written = {path.name[:4] for path in decisions}
    cited = {
        (path.relative_to(ROOT).as_posix(), number)
        for path in SOURCES
        for number in re.findall(r"(?:ADR|[Dd]ecisions?/?) ?(\d{4})\b", path.read_text())
    }
    missing = sorted((name, number) for name, number in cited if number not in written)
    assert not missing, f"decisions cited but not in docs/decisions/: {missing}"


def test_no_source_cites_a_design_outside_the_repository() -> None:
    # The rules the code relies on are in docs/design.md; a citation of a file
    # the repository does not hold is one nobody can follow.
    outside = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in SOURCES
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bDESIGN\.md|\.\./shared/|\bADR \d", line)
    ]
    assert not outside, outside


def test_the_layer_tree_names_every_module() -> None:
    # architecture.md's tree is the map a newcomer reads first: a module it
    # does not name is one nobody was told about.
    tree = section(ROOT / "docs" / "architecture.md", "## Layers")
    package = ROOT / "src" / "intentledger"
    unnamed = [
        path.relative_to(package).as_posix()
        for path in sorted(package.rglob("*.py"))
        if path.name != "__init__.py"
        and "migrations" not in path.parts
        and not re.search(rf"(?<![\w.]){re.escape(path.name)}\b", tree)
    ]
    assert not unnamed, f"modules docs/architecture.md's layer tree does not name: {unnamed}"
