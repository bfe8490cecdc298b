"""The layout of docs/architecture.md, enforced: floors, applications on the public API, no cycles.

Imports are read from the source (``ast``), function-level imports included, so
a lazy import cannot hide a dependency.
"""

import ast
import inspect
import pathlib
import re
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PRIVATE = SRC / "unsplit" / "_src"

# The floors of unsplit._src, bottom first: a module may import its own floor and those below.
FLOORS = (
    (
        "rule and bits",
        {"keys", "random", "masks", "partition", "trees", "extras", "links", "frozen"},
    ),
    ("processes", {"processes"}),
    ("audit", {"audit"}),
    ("step", {"step"}),
    ("bitwise", {"bitwise"}),
    ("front", {"front"}),
    ("integrations", {"dropout", "elastic", "models", "ring"}),
)
APPLICATIONS = ("src/unsplit/demo", "benchmarks", "examples", "tests")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports (absolute names; ``from a import b`` gives a and a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def python_files(*dirs: str) -> list[pathlib.Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def floor_of(name: str) -> int | None:
    """The floor of a module ``unsplit._src.<top>...`` (None: not a floored module)."""
    parts = name.split(".")
    if parts[:2] != ["unsplit", "_src"] or len(parts) < 3:
        return None
    for i, (_, tops) in enumerate(FLOORS):
        if parts[2] in tops:
            return i
    return None


def is_test(path: pathlib.Path) -> bool:
    return path.name.endswith("_test.py") or path.name == "test_util.py"


@pytest.mark.parametrize(
    "path",
    [p for p in python_files("src/unsplit/_src") if not is_test(p) and p.name != "__init__.py"],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_library_modules_import_only_their_floor_and_below(path):
    name = module_name(path)
    mine = floor_of(name)
    assert mine is not None, f"{name} is on no floor of docs/architecture.md; add it to one"
    above = sorted(
        f"{target} ({FLOORS[floor_of(target)][0]})"
        for target in imports(path)
        if floor_of(target) is not None and floor_of(target) > mine
    )
    assert not above, f"{name} ({FLOORS[mine][0]}) imports from a floor above it: {above}"


@pytest.mark.parametrize(
    "path", python_files(*APPLICATIONS), ids=lambda p: str(p.relative_to(ROOT))
)
def test_applications_use_only_the_public_api(path):
    private = sorted(t for t in imports(path) if t.startswith("unsplit._src"))
    assert not private, f"{path.relative_to(ROOT)} imports private code: {private}"


@pytest.mark.parametrize(
    "path", python_files(*APPLICATIONS), ids=lambda p: str(p.relative_to(ROOT))
)
def test_applications_read_no_private_attributes(path):
    # ``step._impl._plans`` reaches into private code as surely as an import does. Private
    # state is ``_lowercase`` (``os._exit`` aside); ``_CONSTANT`` and ``_Type`` names are the
    # tested module's own constants or the standard library's types.
    private = sorted(
        f"{ast.unparse(node)} (line {node.lineno})"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and re.match(r"_[a-z]", node.attr)
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "os"))
    )
    assert not private, f"{path.relative_to(ROOT)} reads private attributes: {private}"


def test_only_the_cli_imports_the_demo():
    importers = {
        str(p.relative_to(ROOT))
        for p in python_files("src", "benchmarks", "examples", "tests")
        if any(t == "unsplit.demo" or t.startswith("unsplit.demo.") for t in imports(p))
        and "demo" not in p.relative_to(SRC).parts[:2]
        and not is_test(p)
    }
    assert importers <= {"src/unsplit/cli.py"}, importers


def test_the_docs_code_uses_only_the_public_api():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            assert "unsplit._src" not in block, f"{page.name} shows private code:\n{block}"


def test_no_import_cycles_between_modules():
    files = {module_name(p): p for p in python_files("src/unsplit") if not is_test(p)}
    graph = {
        name: {t for t in imports(path) if t in files and t != name} for name, path in files.items()
    }
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(name, stack):
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*stack, target])
        state[name] = 2

    for name in sorted(files):
        if name not in state:
            visit(name, [name])


def test_every_test_file_is_named_after_a_module_beside_it():
    orphans = [
        str(p.relative_to(ROOT))
        for p in python_files("src/unsplit")
        if p.name.endswith("_test.py")
        and not (p.parent / p.name.replace("_test.py", ".py")).exists()
    ]
    assert not orphans, f"test files with no module of that name beside them: {orphans}"


def test_no_folder_of_product_code_is_too_big():
    for folder in [PRIVATE, *(p for p in PRIVATE.iterdir() if p.is_dir())]:
        modules = [p for p in folder.glob("*.py") if not is_test(p) and p.name != "__init__.py"]
        assert len(modules) <= 20, f"{folder.relative_to(ROOT)} has {len(modules)} modules"


def test_tests_share_helpers_through_test_util_not_each_other():
    offenders = {
        str(path.relative_to(ROOT)): sorted(t for t in imports(path) if t.endswith("_test"))
        for path in python_files("src")
        if is_test(path)
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, (
        f"test modules import other test modules (move it to test_util): {offenders}"
    )


# A product module holds one idea: at most this many lines; a class or function at most
# LONG lines unless the comment line right above it (``# Long: ...``) says why it stays whole.
MODULE_LINES = 400
LONG = 150


def product_files() -> list[pathlib.Path]:
    return [p for p in python_files("src/unsplit") if not is_test(p)]


def test_product_modules_hold_one_idea():
    big = {
        str(p.relative_to(ROOT)): n
        for p in product_files()
        if (n := len(p.read_text().splitlines())) > MODULE_LINES
    }
    assert not big, f"modules over {MODULE_LINES} lines (split them by idea): {big}"


def test_long_classes_and_functions_say_why():
    unexplained = []
    for path in product_files():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if node.end_lineno - node.lineno + 1 <= LONG:
                continue
            above = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 2
            comment = []  # the comment block right above the definition
            while above >= 0 and lines[above].strip().startswith("#"):
                comment.insert(0, lines[above].strip())
                above -= 1
            if not (comment and comment[0].startswith("# Long:")):
                unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not unexplained, f"over {LONG} lines without a '# Long: why' comment: {unexplained}"


# Even a class that says why it stays whole has one idea per piece: at most this many lines.
CLASS_LINES = 200
# Being split (issue 40, item 7); remove a name here when its class is.
SPLIT_PENDING: set[str] = set()


def test_no_class_is_over_200_lines():
    big = [
        f"{path.relative_to(ROOT)} {node.name}"
        for path in product_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES
    ]
    assert sorted(set(big) - SPLIT_PENDING) == [], f"classes over {CLASS_LINES} lines: {big}"


def public_attributes(cls: type) -> set[str]:
    """The public names a class defines itself: methods, properties, and ``self.x = ...``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = {
        n.name for n in tree.body[0].body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    names |= {
        t.id for n in tree.body[0].body if isinstance(n, ast.Assign) for t in n.targets
        if isinstance(t, ast.Name)
    }  # fmt: skip
    names |= {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }
    return {n for n in names if not n.startswith("_")}


def test_public_attributes_are_for_users():
    # Every public attribute of a public class is documented (its docstring, docs/, the README)
    # or used by an application: nothing public that only the library itself needs.
    import unsplit

    used = "\n".join(
        p.read_text()
        for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *python_files(*APPLICATIONS)]
    )
    unused = []
    for name in unsplit.__all__:
        cls = getattr(unsplit, name)
        if not isinstance(cls, type) or not cls.__module__.startswith("unsplit"):
            continue
        documented = inspect.getdoc(cls) or ""
        for attr in sorted(public_attributes(cls)):
            if not re.search(rf"\.{attr}\b", used) and not re.search(rf"\b{attr}\b", documented):
                unused.append(f"{name}.{attr}")
    assert not unused, f"public attributes no user reads (make them private): {unused}"
