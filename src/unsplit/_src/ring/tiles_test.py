"""A tile's keep bits are the grid rule's at its global position; merges are exact there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from unsplit._src import masks, random
from unsplit._src.ring import tiles

KEY = jax.random.key(3)


@pytest.mark.parametrize(("block", "row0", "col0"), [(8, 16, 24), (6, 12, 18), (4, 0, 4)])
def test_keep_bits_are_the_rules_at_the_tiles_global_position(block, row0, col0):
    heads, threshold = 2, masks.keep_threshold(0.3)
    data = random.key_data(KEY)
    whole = masks.grid_keep_mask_from_data(data, (heads, 64, 64), np.uint32(threshold))
    # Each head's key: fold_in(key, head), as the grid layout defines it.
    words = jnp.stack(
        [jax.random.key_data(jax.random.fold_in(KEY, h)) for h in range(heads)]
    )  # fmt: skip
    options = tiles.Options(block, 1.0, causal=False, threshold=threshold)
    bits = tiles.keep(words, jnp.int32(row0), jnp.int32(col0), options)
    expected = whole[:, row0 : row0 + block, col0 : col0 + block]
    np.testing.assert_array_equal(bits, expected)


def test_merging_with_an_empty_partial_changes_no_bit():
    rng = np.random.default_rng(0)
    p = tiles.Partial(
        jnp.asarray(rng.normal(size=(2, 4)), jnp.float32),
        jnp.asarray(rng.uniform(1, 2, size=(2, 4)), jnp.float32),
        jnp.asarray(rng.normal(size=(4, 2, 3)), jnp.float32),
    )
    nothing = tiles.empty(4, 2, 3, jnp.float32)
    for merged in (tiles.merge(p, nothing), tiles.merge(nothing, p)):
        for a, b in zip(merged, p, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_causal_tile_above_the_diagonal_is_skipped_as_empty():
    options = tiles.Options(4, 1.0, causal=True, threshold=random.LANE_VALUES)
    q = k = v = jnp.ones((4, 1, 2))
    words = jnp.zeros((1, 2), jnp.uint32)
    out = tiles.forward(q, k, v, words, jnp.int32(0), jnp.int32(4), options)
    for a, b in zip(out, tiles.empty(4, 1, 2, jnp.float32), strict=True):
        np.testing.assert_array_equal(a, b)
