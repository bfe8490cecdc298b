"""The canonical tree: both walks pair the merges as bitwise mode's reduction tree does."""

import jax.numpy as jnp
import numpy as np
import pytest

from unsplit._src.bitwise import reduce
from unsplit._src.ring import tree


def _show(a, b):  # a merge whose result spells its pairing
    return f"({a}+{b})"


def _pairing(n: int) -> str:
    """bitwise mode's tree over n chunks, spelled out."""
    return reduce.combine({(i, 1): str(i) for i in range(n)}, n, _show)


@pytest.mark.parametrize("n", range(1, 14))
def test_both_walks_pair_like_bitwise_modes_reduction_tree(n):
    # A merge that is neither associative nor commutative: equal results, equal pairings.
    def merge(a, b):
        return (a * 7 + b * 3 + 1) % 1_000_003

    expected = reduce.combine({(i, 1): i + 1 for i in range(n)}, n, merge)
    stacked = tree.reduce_stacked(jnp.arange(1, n + 1), merge)
    scanned, sides = tree.scan_tree(lambda b: (b + 1, b * 2), n, merge, jnp.int32(0))
    assert int(stacked) == int(scanned) == expected
    assert sides.tolist() == [2 * b for b in range(n)]


def test_the_pairing_is_the_one_spelled_by_bitwise_mode():
    assert _pairing(6) == "(((0+1)+(2+3))+(4+5))"
    assert _pairing(5) == "(((0+1)+(2+3))+4)"


def test_sum_last_adds_in_the_tree():
    x = np.random.default_rng(0).normal(size=(3, 7)).astype(np.float32)
    expected = ((x[:, 0] + x[:, 1]) + (x[:, 2] + x[:, 3])) + ((x[:, 4] + x[:, 5]) + x[:, 6])
    np.testing.assert_array_equal(tree.sum_last(jnp.asarray(x)), expected)
