"""The scripts of examples/ (and benchmarks/) loaded as modules for their tests, as
``python examples/NAME.py`` runs them."""

import contextlib
import importlib.util
import pathlib
import sys
from collections.abc import Iterator
from types import ModuleType

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
BENCHMARKS = EXAMPLES.parent / "benchmarks"


@contextlib.contextmanager
def loaded(name: str, folder: pathlib.Path = EXAMPLES) -> Iterator[ModuleType]:
    """``<folder>/<name>.py`` (default: ``examples/``) as the module ``name``, while the block runs.

    Its folder is first on ``sys.path``, as for the script (it imports ``_schedule``,
    or the benchmarks' ``common``, from there), and the module is registered before it
    runs, as an import would (dataclasses resolves the script's string annotations
    through ``sys.modules[cls.__module__]``). Modules it imported from its folder are
    forgotten afterwards, so the next test loads them afresh.
    """
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    before = set(sys.modules)
    sys.path.insert(0, str(folder))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(folder))
        for other in set(sys.modules) - before:
            origin = getattr(sys.modules[other], "__file__", None) or ""
            if pathlib.Path(origin).parent == folder:
                sys.modules.pop(other, None)
