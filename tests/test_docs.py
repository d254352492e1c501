"""The documentation resolves inside the repository: section references, defect labels, links."""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
ORIGIN_DOC = ROOT / "docs" / "origin_format.md"
#: directories never searched: environments, caches, workspaces, VCS metadata
PRUNED = {"__pycache__", "workspace", "node_modules", "build", "dist"}
SECTION_SIGN = "\u00a7"
SECTION_REF = re.compile(SECTION_SIGN + r"\s*(\d+(?:\.\d+)?)(?:\s*-\s*(\d+(?:\.\d+)?))?")
DEFECT_REF = re.compile(r"\bD(\d{1,2})\b")
HEADING_NUMBER = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)?)\.?\s", re.MULTILINE)
DEFECT_DEFINITION = re.compile(r"^\* \*\*D(\d+)\*\*", re.MULTILINE)


def repo_files(*suffixes: str) -> Iterator[Path]:
    """Files of the repository with these suffixes (hidden directories, .venv and caches left out)."""
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames
                       if not d.startswith(".") and d not in PRUNED and not d.endswith(".egg-info")]
        for name in filenames:
            path = Path(dirpath) / name
            if path.suffix in suffixes and path != Path(__file__).resolve():
                yield path


def cited_files() -> list[Path]:
    """Where sections and defects of docs/origin_format.md are cited: the code and every Markdown page."""
    return sorted(repo_files(".py", ".md"))


def test_every_cited_section_exists_in_origin_format():
    sections = set(HEADING_NUMBER.findall(ORIGIN_DOC.read_text()))
    missing = []
    for path in cited_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in SECTION_REF.finditer(line):
                missing += [f"{path.relative_to(ROOT)}:{n}: {SECTION_SIGN}{number}"
                            for number in match.groups() if number and number not in sections]
    assert not missing, "sections cited but not headings of docs/origin_format.md:\n" + "\n".join(missing)


def test_every_cited_defect_is_defined_in_origin_format():
    text = ORIGIN_DOC.read_text()
    defects = set(DEFECT_DEFINITION.findall(text[text.index("\n## 9. "):]))
    assert defects == {str(i) for i in range(1, 26)}
    unknown = [f"{path.relative_to(ROOT)}:{n}: D{number}"
               for path in cited_files()
               for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
               for number in DEFECT_REF.findall(line) if number not in defects]
    assert not unknown, "defect labels not defined in docs/origin_format.md §9:\n" + "\n".join(unknown)


def test_no_reference_to_the_format_document_outside_the_repository():
    outside = "origin_formats" + ".md"  # the shared document this repository's origin_format.md replaces
    hits = [f"{path.relative_to(ROOT)}:{n}"
            for path in repo_files(".py", ".md", ".toml", ".txt", ".sh", ".cfg", ".yaml", ".yml")
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if outside in line]
    assert not hits, f"{outside} is not in this repository; cite docs/origin_format.md:\n" + "\n".join(hits)


def load_cli_generator() -> ModuleType:
    """docs/gen_cli.py, which is a script beside the docs, not a module of the package."""
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_generated_from_the_cli():
    generated = load_cli_generator().cli_markdown()
    assert (ROOT / "docs" / "cli.md").read_text() == generated, (
        "docs/cli.md is stale: regenerate it with `python docs/gen_cli.py` and commit it")
    for command in ("ingest", "train", "serve", "testbed train"):
        assert f"\n## ctrl {command}\n" in generated


README = ROOT / "README.md"
README_MAX_LINES = 120
FENCED_CODE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def markdown_pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def anchors(page: Path) -> set[str]:
    """The heading anchors GitHub gives a page: lower case, punctuation dropped, spaces -> '-'."""
    seen: dict[str, int] = {}
    found = set()
    for title in HEADING.findall(FENCED_CODE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): "
                                             "move reference material into docs/")


def test_relative_links_point_to_existing_files_and_headings():
    broken = []
    for page in markdown_pages():
        text = INLINE_CODE.sub("", FENCED_CODE.sub("", page.read_text()))
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
