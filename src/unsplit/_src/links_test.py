"""Every page and section that a message or docstring names exists in docs/."""

import ast
import pathlib
import re
import tomllib
import unicodedata

import pytest

from unsplit._src import links

ROOT = pathlib.Path(__file__).resolve().parents[3]
SRC = ROOT / "src" / "unsplit"
DOCS = ROOT / "docs"

# Files allowed to name repository paths (none: every message names the site's pages).
LEAD: set[str] = set()


def slug(heading: str) -> str:
    """The anchor mkdocs gives a heading (Python-Markdown's toc slugify; code marks dropped)."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore")
    text = re.sub(r"[^\w\s-]", "", text.decode()).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: str) -> set[str]:
    text = re.sub(r"^```.*?^```", "", (DOCS / f"{page}.md").read_text(), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)}


def library_files() -> list[pathlib.Path]:
    return sorted(p for p in SRC.rglob("*.py") if not p.name.endswith("_test.py"))


def named_pages() -> set[tuple[str, str, str]]:
    """(file, page, section) for every site address and doc_page/doc_ref call in src/."""
    found = set()
    address = re.escape(links.DOCS) + r"([\w-]+)/(?:#([\w-]+))?"
    for path in library_files():
        text, where = path.read_text(), str(path.relative_to(SRC))
        found.update((where, page, section) for page, section in re.findall(address, text))
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", ""))
                in ("doc_page", "doc_ref")
                and node.args
                and all(isinstance(a, ast.Constant) for a in node.args)
            ):
                page, section = ([a.value for a in node.args] + [""])[:2]
                found.add((where, page, section))
    return found


def test_the_site_address_is_pyprojects_documentation_url():
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert urls["Documentation"] == links.DOCS


def test_every_guide_has_a_title_and_the_same_title_in_the_sites_navigation():
    assert set(links.TITLES) == {p.stem for p in DOCS.glob("*.md")}
    nav = (ROOT / "mkdocs.yml").read_text()
    for page, title in links.TITLES.items():
        assert f"- {title}: {page}.md" in nav, (page, title)


def test_every_page_and_section_named_in_src_exists():
    named = named_pages()
    assert any(page == "bitwise" for _, page, _ in named)  # the scan finds the names
    for where, page, section in sorted(named):
        assert (DOCS / f"{page}.md").exists(), f"{where} names a page {page!r} not in docs/"
        if section:
            assert section in anchors(page), f"{where} names {page}#{section}: no such section"


def test_messages_and_docstrings_name_pages_not_repository_paths():
    for path in library_files():
        where = str(path.relative_to(SRC))
        if where in LEAD:
            continue
        paths = re.findall(r"(?:docs|benchmarks)/[\w.]+", path.read_text())
        assert not paths, f"{where} names {paths}: use links.doc_ref or the site's address"


def test_doc_page_refuses_a_page_that_is_not_a_guide():
    with pytest.raises(ValueError, match=r"no guide 'bitwize'; expected one of \[.*'bitwise'"):
        links.doc_page("bitwize")


def test_the_slugs_are_the_sites_anchors():
    assert slug("Accelerators (GPU, TPU)") == "accelerators-gpu-tpu"
    assert slug("The whole run: `train_step`, optimizer included") == (
        "the-whole-run-train_step-optimizer-included"
    )
