"""The documentation's own rules: an architecture a newcomer reads in one sitting, true to the plugin and backend
contracts it lists, decision records that are reachable, links that resolve, and product docs that describe the
product, not the environment it was built in. Reads files only (well under a second)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
ARCHITECTURE = DOCS / "architecture.md"
DECISIONS = DOCS / "decisions"
CORE = REPO / "packages" / "engine-core" / "src" / "drivetrain_engine_core"
MAX_ARCHITECTURE_LINES = 500
MARKDOWN = sorted(
    [
        REPO / "README.md",
        REPO / "benchmarks" / "README.md",
        *DOCS.rglob("*.md"),
        *REPO.glob("packages/*/README.md"),
        *REPO.glob("examples/*/README.md"),
    ]
)
# Product docs describe the product: these name the tooling of an environment the project was developed in.
ENVIRONMENT_PHRASES = ("device tool", "workplace", "run(command=", "device machine", "remote-run")
PRODUCT_TEXTS = [
    *MARKDOWN,
    REPO / ".ci" / "gpu-device",
    REPO / ".ci" / "gpu-wheels",
    REPO / ".ci" / "gpu-lane",
]
RECORD_PARTS = ("## Context", "## Decision", "## Consequences", "## Evidence")

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)


def _relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _shown(target: Path, page: Path) -> str:
    """``target`` relative to the repository, or to the linking page's folder outside it."""
    root = REPO if target.is_relative_to(REPO) else page.parent
    return target.relative_to(root).as_posix()


def _prose(path: Path) -> str:
    """The file without its fenced code blocks (a link inside code is an example, not a link)."""
    return _FENCE.sub("", path.read_text())


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's ``-1``, ``-2`` suffixes for repeated ones."""
    seen: dict[str, int] = {}
    result = set()
    for heading in _HEADING.findall(_prose(path)):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        result.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return result


def broken_links(path: Path) -> list[str]:
    """Relative links of ``path`` whose file, or heading anchor in a Markdown file, does not exist."""
    broken = []
    for target in _LINK.findall(_prose(path)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {_shown(resolved, path)})")
    return broken


def test_the_architecture_reads_in_one_sitting() -> None:
    lines = len(ARCHITECTURE.read_text().splitlines())
    assert lines < MAX_ARCHITECTURE_LINES, (
        f"docs/architecture.md has {lines} lines (under {MAX_ARCHITECTURE_LINES}): it says what is; move history, "
        "rationale and measurements to a decision record in docs/decisions/"
    )


def _decorated_functions(path: Path, decorator: str) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == decorator for d in node.decorator_list)
    ]


def test_the_architecture_lists_every_plugin_hook() -> None:
    hooks = _decorated_functions(CORE / "_hookspecs.py", "hookspec")
    assert "register_rollouts" in hooks and len(hooks) >= 5
    text = ARCHITECTURE.read_text()
    missing = [hook for hook in hooks if f"`{hook}(" not in text]
    assert not missing, f"docs/architecture.md §9 lacks these hookspecs.py hooks: {missing}"


def test_the_architecture_lists_every_backend_hook() -> None:
    """The §3 table names every member ``BackendHooks`` declares for a backend to implement."""
    tree = ast.parse((CORE / "_hooks.py").read_text())
    backend_hooks = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BackendHooks")
    members = [
        node.name
        for node in backend_hooks.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("__")
    ]
    text = ARCHITECTURE.read_text()
    missing = [name for name in members if f"`{name}" not in text]
    assert len(members) > 20 and not missing, (
        f"docs/architecture.md §3 lacks these BackendHooks members: {missing}"
    )


@pytest.mark.parametrize("path", MARKDOWN, ids=_relative)
def test_relative_links_resolve(path: Path) -> None:
    assert not broken_links(path), f"{_relative(path)}: {broken_links(path)}"


def test_the_link_check_sees_a_broken_link_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Real heading (`code`)\n\n## Real heading (`code`)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#real-heading-code) [again](other.md#real-heading-code-1) [self](#nope) [gone](missing.md)\n"
        "[anchor](other.md#nope) [web](https://example.org/x.md)\n```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(page) == [
        "#nope (no heading #nope in page.md)",
        "missing.md (no such file)",
        "other.md#nope (no heading #nope in other.md)",
    ]


def _records() -> list[Path]:
    return sorted(DECISIONS.glob("[0-9][0-9][0-9][0-9]-*.md"))


def test_decision_records_are_numbered_reachable_and_complete() -> None:
    records = _records()
    numbers = [int(path.name[:4]) for path in records]
    assert numbers == list(range(1, len(records) + 1)), (
        f"records are numbered 0001 on, without gaps: {numbers}"
    )
    index = (DECISIONS / "README.md").read_text()
    architecture = ARCHITECTURE.read_text()
    problems = []
    for path in records:
        text = path.read_text()
        if f"({path.name})" not in index:
            problems.append(f"{path.name}: not in docs/decisions/README.md's index")
        if f"(decisions/{path.name})" not in architecture:
            problems.append(f"{path.name}: no link from the docs/architecture.md section it concerns")
        if not text.startswith(f"# {path.name[:4]}. "):
            problems.append(f"{path.name}: the title is '# {path.name[:4]}. <decision>'")
        problems += [f"{path.name}: lacks '{part}'" for part in RECORD_PARTS if f"\n{part}\n" not in text]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", PRODUCT_TEXTS, ids=_relative)
def test_product_docs_do_not_describe_a_development_environment(path: Path) -> None:
    text = path.read_text().lower()
    found = [phrase for phrase in ENVIRONMENT_PHRASES if phrase in text]
    assert not found, (
        f"{_relative(path)} describes the environment it was built in ({found}): describe the product"
    )
