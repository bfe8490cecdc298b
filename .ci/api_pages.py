"""Every public name is on its API page: the facades' ``__all__`` against docs/api/*.md.

``python .ci/api_pages.py`` checks the pages' markdown (each facade's page lists exactly its
``__all__``); ``python .ci/api_pages.py site`` also checks the built site (each name has its
anchor, with a signature and a docstring, on its page). ``./dev docs`` runs the second after
``mkdocs build --strict``; tests/docs_test.py runs the first without mkdocs. The facades'
``__all__`` is read from their source, so neither needs the extras (Flax, grain, ...) installed.
"""

import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "unsplit"
API = ROOT / "docs" / "api"

# Public module -> (its source, its API page).
FACADES = {
    "unsplit": (SRC / "__init__.py", API / "unsplit.md"),
    "unsplit.linen": (SRC / "linen.py", API / "linen.md"),
    "unsplit.nnx": (SRC / "nnx.py", API / "nnx.md"),
    "unsplit.equinox": (SRC / "equinox.py", API / "equinox.md"),
    "unsplit.data": (SRC / "data.py", API / "data.md"),
    "unsplit.checkpoint": (SRC / "checkpoint.py", API / "checkpoint.md"),
    "unsplit.testing": (SRC / "testing" / "__init__.py", API / "testing.md"),
    "unsplit.models": (SRC / "models.py", API / "models.md"),
}


def public_names(source: pathlib.Path) -> list[str]:
    """The ``__all__`` of a module, read from its source."""
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise ValueError(f"{source} defines no __all__")


def submodules(module: str) -> set[str]:
    """Names of ``__all__`` that are public modules with a page of their own."""
    return {name.rsplit(".", 1)[1] for name in FACADES if name.startswith(module + ".")}


def listed_members(page: pathlib.Path, module: str) -> tuple[list[str], list[str]]:
    """The ``members:`` of the page's ``::: module`` block, and the submodules it links to."""
    text = page.read_text()
    block = re.search(rf"^::: {re.escape(module)}\n((?:[ \t]+.*\n|\n)*)", text, re.M)
    members = re.findall(r"^\s+- (\w+)\s*$", block.group(1), re.M) if block else []
    return members, [name for name in submodules(module) if f"({name}.md)" in text]


def shown(path: pathlib.Path) -> pathlib.Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def check_markdown() -> list[str]:
    problems = []
    for module, (source, page) in FACADES.items():
        if not page.exists():
            problems.append(f"{module}: no API page {shown(page)}")
            continue
        names = public_names(source)
        members, linked = listed_members(page, module)
        for name in sorted(set(names) - set(members) - set(linked)):
            problems.append(f"{shown(page)}: {module}.{name} is in __all__, not listed")
        for name in sorted(set(members) - set(names)):
            problems.append(f"{shown(page)}: lists {module}.{name}, not in __all__")
    return problems


def check_site(site: pathlib.Path) -> list[str]:
    """Each name has its heading anchor, a signature or a docstring on its built page."""
    problems = []
    for module, (source, page) in FACADES.items():
        html_path = site / "api" / page.stem / "index.html"
        if not html_path.exists():
            problems.append(f"{html_path}: not built")
            continue
        html = html_path.read_text()
        for name in public_names(source):
            if name in submodules(module):
                if f'href="../{name}/' not in html:
                    problems.append(f"{html_path}: no link to the page of {module}.{name}")
                continue
            anchor = f'id="{module}.{name}"'
            at = html.find(anchor)
            if at < 0:
                problems.append(f"{html_path}: no entry for {module}.{name}")
            elif "doc-contents" not in html[at : at + 20_000]:
                problems.append(f"{html_path}: {module}.{name} has no contents")
    return problems


def main(argv: list[str]) -> int:
    problems = check_markdown() + (check_site(pathlib.Path(argv[0])) if argv else [])
    for problem in problems:
        print(f"api_pages: {problem}", file=sys.stderr)
    if problems:
        print(
            "api_pages: fix: list every name of the facade's __all__ under its page's "
            "'::: module' members (docs/api/)",
            file=sys.stderr,
        )
        return 1
    count = sum(len(public_names(source)) for source, _ in FACADES.values())
    print(f"api_pages: the {count} public names of {len(FACADES)} modules are on their pages")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
