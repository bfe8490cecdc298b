"""The scripts of examples/ loaded as modules for their tests, as ``python examples/NAME.py`` runs them."""

import contextlib
import importlib.util
import pathlib
import sys
from collections.abc import Iterator
from types import ModuleType

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@contextlib.contextmanager
def loaded(name: str) -> Iterator[ModuleType]:
    """``examples/<name>.py`` as the module ``name``, while the block runs.

    Its folder is first on ``sys.path``, as for the script (it imports ``_schedule``
    from there), and the module is registered before it runs, as an import would
    (dataclasses resolves the script's string annotations through
    ``sys.modules[cls.__module__]``).
    """
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(EXAMPLES))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(EXAMPLES))
