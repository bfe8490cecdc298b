"""Picks the fast subset of the suite from pytest's collected ids (stdin): every module, once.

Keeps every doctest, and of each module its first ``FUNCTIONS`` test functions, each with
its first parameter case only, so every module runs on the newest versions (their imports,
their doctests, their first checks) while the grids (devices x microbatches x ...) run in
the full suite. The drop-in modules run whole: their contract is "behave like the installed Flax /
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

# Test functions per module (in collection order): CI's whole run must stay within its time.
FUNCTIONS = 2

# Negative controls show that a naive scheme (per-device keys, one key per microbatch, a mean
# of means) gives other numbers, i.e. that the grids can fail: the full suite shows it once;
# the newest-JAX subset checks that unsplit itself works there.
SKIP_FUNCTIONS = "::test_negative_control"


def fast_subset(ids: list[str]) -> list[str]:
    """The ids to run, in collection order.

    Example:
        >>> fast_subset(["a_test.py::test_t[1]", "a_test.py::test_t[2]", "a_test.py::test_u", "m.py::m.f"])
        ['a_test.py::test_t[1]', 'a_test.py::test_u', 'm.py::m.f']
        >>> len(fast_subset([f"a_test.py::test_{i}" for i in range(5)])) == FUNCTIONS
        True
        >>> fast_subset(["x/dropout/linen_test.py::test_t[1]", "x/dropout/linen_test.py::test_t[2]"])
        ['x/dropout/linen_test.py::test_t[1]', 'x/dropout/linen_test.py::test_t[2]']
        >>> fast_subset(["tests/architecture_test.py::test_t", "tests/core_test.py::test_t"])
        ['tests/core_test.py::test_t']
        >>> fast_subset(["a_test.py::test_negative_control_keys", "a_test.py::test_keys"])
        ['a_test.py::test_keys']
    """
    seen, per_module, keep = set(), {}, []
    for node in ids:
        function = node.split("[", 1)[0]
        module, name = function.split("::", 1)
        if module.endswith(SKIP) or SKIP_FUNCTIONS in function:
            continue
        if module.endswith(WHOLE) or not name.startswith("test"):  # drop-ins, doctests
            keep.append(node)
        elif function not in seen and per_module.get(module, 0) < FUNCTIONS:
            seen.add(function)
            per_module[module] = per_module.get(module, 0) + 1
            keep.append(node)
    return keep


if __name__ == "__main__":
    collected = [line.strip() for line in sys.stdin if "::" in line]
    print("\n".join(fast_subset(collected)))
