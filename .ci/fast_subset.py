"""Picks the fast subset of the suite from pytest's collected ids (stdin): every module, once.

Keeps every doctest, and of each test function its first parameter case only, so every
module and every test function runs while the grids (devices x microbatches x ...) run
once. The drop-in modules run whole: their contract is "behave like the installed Flax /
Equinox", whose checks change between versions (Flax 0.12.12's nnx attention added errors
that only the ``[nnx]`` cases saw). Tests marked slow or multiprocess are left out before
this by ``-m``.

Usage: pytest --co -q -m "not slow and not multiprocess" | python .ci/fast_subset.py
"""

import sys

# Drop-ins of another library: every case runs on the newest versions too.
# Matched against the end of each test file's path (src/unsplit/_src/dropout/...).
WHOLE = (
    "dropout/attention_test.py",
    "dropout/linen_test.py",
    "dropout/nnx_test.py",
    "dropout/equinox_test.py",
)

# Checks of the source tree itself (imports, sizes, docstrings: read with ast), which no JAX
# version changes: the full suite runs them; the newest-JAX subset leaves them out.
SKIP = ("tests/architecture_test.py",)

# Negative controls show that a naive scheme (per-device keys, one key per microbatch, a mean
# of means) gives other numbers, i.e. that the grids can fail: the full suite shows it once;
# the newest-JAX subset checks that unsplit itself works there.
SKIP_FUNCTIONS = "::test_negative_control"


def fast_subset(ids: list[str]) -> list[str]:
    """The ids to run, in collection order.

    Example:
        >>> fast_subset(["a_test.py::t[1]", "a_test.py::t[2]", "a_test.py::u", "m.py::m.f"])
        ['a_test.py::t[1]', 'a_test.py::u', 'm.py::m.f']
        >>> fast_subset(["x/dropout/linen_test.py::t[1]", "x/dropout/linen_test.py::t[2]"])
        ['x/dropout/linen_test.py::t[1]', 'x/dropout/linen_test.py::t[2]']
        >>> fast_subset(["tests/architecture_test.py::t", "tests/core_test.py::t"])
        ['tests/core_test.py::t']
        >>> fast_subset(["a_test.py::test_negative_control_keys", "a_test.py::test_keys"])
        ['a_test.py::test_keys']
    """
    seen, keep = set(), []
    for node in ids:
        function = node.split("[", 1)[0]
        if function.split("::", 1)[0].endswith(SKIP) or SKIP_FUNCTIONS in function:
            continue
        if function.split("::", 1)[0].endswith(WHOLE):
            keep.append(node)
        elif function not in seen:
            seen.add(function)
            keep.append(node)
    return keep


if __name__ == "__main__":
    collected = [line.strip() for line in sys.stdin if "::" in line]
    print("\n".join(fast_subset(collected)))
