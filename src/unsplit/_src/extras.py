"""Optional integrations: each needs its library, installed with an extra of unsplit.

``pip install unsplit`` brings only JAX, NumPy, optax and rich: the step, its
bitwise mode, the audit and the multi-process tools. Everything built on another
library is an extra, and its public module calls :func:`require` first, so a
missing library is an ImportError that names the extra to install.

Example:
    >>> from unsplit._src.extras import require
    >>> require("numpy", extra="numpy", what="this example")
    >>> try:
    ...     require("not_a_real_module", extra="flax", what="unsplit.linen")
    ... except ImportError as e:
    ...     print(e)
    unsplit.linen needs not_a_real_module, which is not installed. Fix: pip install 'unsplit[flax]' (or 'unsplit[all]').
"""

from __future__ import annotations

import importlib

#: The extras of ``pyproject.toml``: extra -> the modules it provides.
EXTRAS = {
    "flax": ("flax",),
    "equinox": ("equinox",),
    "data": ("grain",),
    "checkpoint": ("orbax.checkpoint",),
    "demo": ("flax", "grain", "orbax.checkpoint", "matplotlib"),
}


def require(module: str, *, extra: str, what: str) -> None:
    """Imports ``module`` or raises ImportError naming ``pip install 'unsplit[extra]'``."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs {module}, which is not installed. Fix: pip install "
            f"'unsplit[{extra}]' (or 'unsplit[all]')."
        ) from e
