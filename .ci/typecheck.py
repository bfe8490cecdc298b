"""Type checks: src/unsplit, and the python examples of README.md and docs/*.md.

Runs basedpyright (settings in pyproject.toml's [tool.basedpyright]) on the package, then
on the ```python blocks of each page, written one file a page (a page's blocks run in one
namespace, as tests/docs_test.py runs them) into a temporary folder. Arguments are passed on
to basedpyright (``--pythonpath .venv/bin/python`` picks the venv whose packages it reads).
"""

import json
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Errors in the examples that are not the examples' fault: (page, text of the message, why).
KNOWN = [
    # Flax annotates Module.apply as `Any | tuple[Any, FrozenVariableDict | dict]` (the pair is
    # what mutable=... returns); every user's `model.apply(...)` without it reads the same.
    ("", "FrozenVariableDict", "flax.linen.Module.apply's return annotation"),
]


def page_code(page: pathlib.Path) -> str:
    """The page's python blocks, one after another, each under a comment naming its line."""
    text = page.read_text()
    parts = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        line = text.count("\n", 0, match.start()) + 2
        parts.append(f"# {page.name}:{line}\n{match.group(1)}")
    # A page's blocks are fragments of one story: they use names its prose defines (params,
    # batch, loss_fn), so names used but not defined are not errors; everything else is.
    header = "# pyright: reportUndefinedVariable=false, reportUnboundVariable=false\n"
    return header + "\n".join(parts) if parts else ""


def page_line(code: str, line: int) -> str:
    """``page.md:N`` of a line of a page's code file (0-based ``line``)."""
    lines = code.splitlines()[: line + 1]
    for back, text in enumerate(reversed(lines)):
        if match := re.match(r"# (\S+\.md):(\d+)$", text):
            return f"{match.group(1)}:{int(match.group(2)) + back - 1}"
    return f"?:{line + 1}"


def check_examples(pyright: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="unsplit-examples-") as folder:
        codes = {}
        for page in PAGES:
            if code := page_code(page):
                path = pathlib.Path(folder) / f"{page.stem}_md.py"
                path.write_text(code)
                codes[str(path)] = (page.name, code)
        done = subprocess.run(
            [*pyright, "--outputjson", *codes], cwd=ROOT, capture_output=True, text=True
        )
    errors = known = 0
    for diagnostic in json.loads(done.stdout)["generalDiagnostics"]:
        if diagnostic["severity"] != "error":
            continue
        page, code = codes[diagnostic["file"]]
        message = diagnostic["message"]
        if any(page.startswith(p) and text in message for p, text, _ in KNOWN):
            known += 1
            continue
        errors += 1
        where = page_line(code, diagnostic["range"]["start"]["line"])
        print(f"{where}: error: {message} ({diagnostic.get('rule', '')})")
    print(
        f"typecheck: the python blocks of {len(codes)} pages: {errors} errors"
        f" ({known} known, listed in .ci/typecheck.py)"
    )
    return 1 if errors else 0


def main(args: list[str]) -> int:
    pyright = [sys.executable, "-m", "basedpyright", "--project", str(ROOT / "pyproject.toml")]
    package = subprocess.run([*pyright, *args], cwd=ROOT).returncode
    return check_examples([*pyright, *args]) or package


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
