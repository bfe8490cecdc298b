"""Picks the fast subset of the suite from pytest's collected ids (stdin): every module, once.

Keeps every doctest, and of each test function its first parameter case only, so every
module and every test function runs while the grids (devices x microbatches x ...) run
once. Tests marked slow or multiprocess are left out before this by ``-m``.

Usage: pytest --co -q -m "not slow and not multiprocess" | python .ci/fast_subset.py
"""

import sys


def fast_subset(ids: list[str]) -> list[str]:
    """The ids to run, in collection order.

    Example:
        >>> fast_subset(["a_test.py::t[1]", "a_test.py::t[2]", "a_test.py::u", "m.py::m.f"])
        ['a_test.py::t[1]', 'a_test.py::u', 'm.py::m.f']
    """
    seen, keep = set(), []
    for node in ids:
        function = node.split("[", 1)[0]
        if function not in seen:
            seen.add(function)
            keep.append(node)
    return keep


if __name__ == "__main__":
    collected = [line.strip() for line in sys.stdin if "::" in line]
    print("\n".join(fast_subset(collected)))
