"""The canonical tree: any contiguous split of the chunks gives the same order of adds."""

import itertools

import numpy as np
import pytest

from unsplit._src.bitwise import reduce


def expr(a, b):
    return f"({a}+{b})"


def canonical(n):
    """The reference: the whole range pushed through one accumulator."""
    acc = reduce.Accumulator(expr)
    for g in range(n):
        acc.push(g, f"c{g}")
    return reduce.combine(acc.blocks, n, expr)


def split_sum(n, cuts):
    bounds = [0, *cuts, n]
    blocks = {}
    for a, b in itertools.pairwise(bounds):
        acc = reduce.Accumulator(expr)
        for g in range(a, b):
            acc.push(g, f"c{g}")
        assert list(acc.blocks) == reduce.aligned_blocks(a, b)
        blocks.update(acc.blocks)
    return reduce.combine(blocks, n, expr)


def test_small_trees_written_out():
    assert canonical(1) == "c0"
    assert canonical(4) == "((c0+c1)+(c2+c3))"
    assert canonical(6) == "(((c0+c1)+(c2+c3))+(c4+c5))"
    assert canonical(3) == "((c0+c1)+c2)"


@pytest.mark.parametrize("seed", range(40))
def test_any_contiguous_split_gives_the_same_tree(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 100))
    parts = int(rng.integers(1, min(n, 9) + 1))
    cuts = sorted(rng.choice(np.arange(1, n), size=parts - 1, replace=False)) if n > 1 else []
    assert split_sum(n, [int(c) for c in cuts]) == canonical(n)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 100, 1000])
def test_partial_sums_alive_are_logarithmic(n):
    depths = []
    acc = reduce.Accumulator(expr)
    for g in range(n):
        acc.push(g, "x")
        depths.append(acc.depth)
    assert max(depths) <= max(n - 1, 1).bit_length()
    # An unaligned range is at most two staircases of blocks.
    assert len(reduce.aligned_blocks(3, n + 3)) <= 2 * (n + 3).bit_length()


def test_evenly_split_power_of_two_shares_are_single_blocks():
    for devices in (1, 2, 4, 8):
        per = 64 // devices
        assert all(
            reduce.aligned_blocks(d * per, (d + 1) * per) == [(d * per, per)]
            for d in range(devices)
        )


def test_errors():
    acc = reduce.Accumulator(expr)
    acc.push(0, "a")
    with pytest.raises(ValueError, match="pushed in order: expected 1, got 2"):
        acc.push(2, "b")
    with pytest.raises(ValueError, match="cover 1 chunks, expected 2"):
        reduce.combine({(0, 1): "a"}, 2, expr)
