"""Tests of the prefix-stable 16-bit lanes: golden bits, prefix stability, statistics.

The statistical tests use fixed keys, so they are deterministic; each states its
false-failure probability: the chance that *ideal* random bits would fail it
(i.e. the chance that a JAX upgrade that changes streams, or a new key, makes a
correct generator fail). Every test function is at most 1e-6 by a union bound.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import random as jex_random
from scipy import stats

import unsplit
from unsplit._src import masks, random
from unsplit._src import test_util as testing

ALPHA = 1e-7  # false-failure probability of each single statistical check

# lanes16(jax.random.key(0), (12,)): blocks 0, 1, 2 of threefry2x32(key, (0, m)).
GOLDEN_LANES_KEY0 = [345, 27424, 20222, 39354, 9103, 14175, 5405, 52699, 20137, 63263, 16513, 41486]
# lanes16(jax.random.key(7), (2, 6)).
GOLDEN_LANES_KEY7 = [
    [25739, 55319, 19840, 29830, 10431, 2976],
    [22207, 61984, 38825, 14744, 48643, 29727],
]
# keep_mask(jax.random.key(42), (4, 8), 0.5), each row read as 8 binary digits.
GOLDEN_MASK_ROWS_KEY42 = [0b11110100, 0b10011001, 0b00001011, 0b00101011]


def test_golden_lanes_pinned():
    got = random.lanes16(jax.random.key(0), (12,))
    assert got.dtype == jnp.uint32
    np.testing.assert_array_equal(got, GOLDEN_LANES_KEY0)
    np.testing.assert_array_equal(random.lanes16(jax.random.key(7), (2, 6)), GOLDEN_LANES_KEY7)


# grid_lanes16(jax.random.key(7), (2, 2, 6)): [head, query, key position].
GOLDEN_GRID_KEY7 = [
    [[51068, 41774, 14425, 32037, 10792, 8140], [25523, 39857, 40596, 13740, 41169, 32195]],
    [[47066, 19745, 14533, 57844, 21211, 24573], [49943, 8783, 54970, 743, 13552, 43235]],
]


def test_golden_grid_lanes_pinned():
    np.testing.assert_array_equal(
        random.grid_lanes16(jax.random.key(7), (2, 2, 6)), GOLDEN_GRID_KEY7
    )


def test_grid_layout_is_fold_in_per_leading_coordinate_then_row_and_block():
    """Element (b, h, r, c): lane c % 4 of threefry2x32(fold_in(fold_in(key, b), h), (r, c // 4))."""
    key = jax.random.key(3)
    grid = np.asarray(random.grid_lanes16(key, (2, 3, 5, 7)))
    for b, h, r in [(0, 0, 0), (1, 2, 4), (0, 1, 3)]:
        sub = jax.random.fold_in(jax.random.fold_in(key, b), h)
        counters = np.array([r, r, 0, 1], np.uint32)  # hi words, then lo words (blocks 0, 1)
        out = np.asarray(jex_random.threefry_2x32(jax.random.key_data(sub), counters))
        w0, w1 = out[:2], out[2:]
        lanes = np.stack([w0 & 0xFFFF, w0 >> 16, w1 & 0xFFFF, w1 >> 16], axis=-1).reshape(-1)
        np.testing.assert_array_equal(grid[b, h, r], lanes[:7])
    # No leading axes: the key itself is used, row r, block c // 4.
    out = np.asarray(
        jex_random.threefry_2x32(jax.random.key_data(key), np.array([2, 0], np.uint32))
    )
    lanes = [out[0] & 0xFFFF, out[0] >> 16, out[1] & 0xFFFF, out[1] >> 16]
    np.testing.assert_array_equal(random.grid_lanes16(key, (5, 7))[2, :4], lanes)


@pytest.mark.parametrize(
    ("small", "big"),
    [((2, 5, 5), (2, 10, 10)), ((1, 3, 4, 6), (2, 4, 9, 13)), ((7, 3), (16, 16))],
)
def test_grid_bits_depend_on_coordinates_not_extents(small, big):
    key = jax.random.key(13)
    cut = tuple(slice(0, n) for n in small)
    np.testing.assert_array_equal(
        random.grid_lanes16(key, big)[cut], random.grid_lanes16(key, small)
    )


def test_grid_of_a_batch_row_is_the_grid_of_its_fold_in_key():
    key = jax.random.key(17)
    batched = random.grid_lanes16(key, (3, 2, 4, 8))
    for b in range(3):
        np.testing.assert_array_equal(
            batched[b], random.grid_lanes16(jax.random.fold_in(key, b), (2, 4, 8))
        )


def test_grid_heads_and_rows_are_independent():
    """Pair checks between heads, between rows and between keys of one grid.

    Chi-square (3 dof) at 1e-7 each, three checks: false failure <= 3e-7.
    """
    rate = 0.5
    mask = np.asarray(random.grid_lanes16(jax.random.key(600), (2, 512, 512)))
    mask = mask < masks.keep_threshold(rate)
    p = masks.keep_threshold(rate) / 2**16
    pairs = [(mask[0], mask[1]), (mask[0, ::2], mask[0, 1::2]), (mask[1, :, ::2], mask[1, :, 1::2])]
    for a, b in pairs:
        statistic = _pair_statistic(a.ravel(), b.ravel(), p)
        assert statistic < stats.chi2.isf(ALPHA, 3), statistic
    kept = int(mask.sum())
    low, high = stats.binom.interval(1 - ALPHA, mask.size, p)
    assert low <= kept <= high


def test_golden_mask_bits_pinned():
    mask = np.asarray(masks.keep_mask(jax.random.key(42), (4, 8), 0.5))
    rows = [int("".join(str(int(b)) for b in row), 2) for row in mask]
    assert rows == GOLDEN_MASK_ROWS_KEY42


def test_layout_is_threefry_of_the_block_counter():
    """Lane j of block m is 16 bits of threefry2x32(key, (hi=0, lo=m)), as documented."""
    key = jax.random.key(3)
    counters = jnp.array([0, 0, 0, 0, 1, 2], jnp.uint32)  # hi words, then lo words
    out = np.asarray(jex_random.threefry_2x32(jax.random.key_data(key), counters))
    w0, w1 = out[:3], out[3:]
    want = np.stack([w0 & 0xFFFF, w0 >> 16, w1 & 0xFFFF, w1 >> 16], axis=-1).reshape(-1)
    np.testing.assert_array_equal(random.lanes16(key, (12,)), want)


def test_legacy_raw_key_gives_the_typed_key_bits():
    np.testing.assert_array_equal(
        random.lanes16(jax.random.PRNGKey(0), (12,)), random.lanes16(jax.random.key(0), (12,))
    )


@pytest.mark.parametrize(
    ("short", "long"),
    [
        ((5, 12), (9, 12)),  # padding the leading axis (fast path)
        ((3, 7), (8, 7)),  # last axis not a multiple of 4 (flat path)
        ((13,), (40,)),  # a 1-D input padded at its end
        ((2, 3, 8), (6, 3, 8)),
    ],
)
def test_prefix_stable_when_padded_longer(short, long):
    key = jax.random.key(11)
    a = np.asarray(random.lanes16(key, short)).reshape(-1)
    b = np.asarray(random.lanes16(key, long)).reshape(-1)
    np.testing.assert_array_equal(a, b[: a.size])


def test_same_flat_index_same_bits_for_every_shape():
    key = jax.random.key(5)
    flat = np.asarray(random.lanes16(key, (72,)))
    for shape in [(6, 12), (8, 9), (3, 24), (2, 3, 12), (72, 1), (1, 72)]:
        np.testing.assert_array_equal(np.asarray(random.lanes16(key, shape)).reshape(-1), flat)


def test_edge_shapes():
    key = jax.random.key(0)
    assert random.lanes16(key, (0, 5)).shape == (0, 5)
    assert int(random.lanes16(key, ())) == GOLDEN_LANES_KEY0[0]
    assert masks.keep_mask(key, (3, 0), 0.5).dtype == jnp.bool_


def test_one_hash_per_four_elements():
    """The speed design: threefry runs on size/4 counters (jax.random.bernoulli: size)."""
    jaxpr = jax.make_jaxpr(lambda k: masks.keep_mask(k, (64, 128), 0.1))(jax.random.key(0))
    assert testing.threefry_sizes(jaxpr.jaxpr) == [64 * 128 // 4]
    # The grid layout: one hash per (batch, head) coordinate to fold it in, then one per 4.
    grid = jax.make_jaxpr(lambda k: random.grid_lanes16(k, (2, 8, 64, 128)))(jax.random.key(0))
    assert testing.threefry_sizes(grid.jaxpr) == [2 * 8, 2 * 8, 2 * 8 * 64 * 128 // 4]


def test_written_out_threefry_equals_jax():
    words = np.random.default_rng(0).integers(0, 2**32, (4, 257), dtype=np.uint32)
    words[:, :3] = [[0, 0, 2**32 - 1], [0, 1, 2**32 - 1], [0, 0, 2**32 - 1], [0, 7, 2**32 - 1]]
    w0, w1 = random.threefry2x32(*words)
    for i in range(words.shape[1]):
        want = jex_random.threefry_2x32(words[:2, i], words[2:, i])
        np.testing.assert_array_equal([w0[i], w1[i]], want)


def test_keep_threshold_resolution():
    assert masks.keep_threshold(0.0) == 2**16
    assert masks.keep_threshold(1.0) == 0
    assert masks.keep_threshold(0.5) == 2**15
    for rate in np.linspace(0.0, 1.0, 1001):
        assert abs(masks.keep_threshold(rate) / 2**16 - (1 - rate)) <= 2**-17
    # Near rate 1 the threshold never rounds to 0 (which would drop everything and bias
    # the expectation); near rate 0 it may round to 2**16 (keep all, scale 1: unbiased).
    for rate in [1 - 2**-17, 1 - 1e-6, 1 - 1e-9]:
        assert masks.keep_threshold(rate) == 1
    assert masks.keep_threshold(1e-6) == 2**16


def test_traced_threshold_equals_the_python_one():
    rates = np.concatenate([np.linspace(0, 1, 257), [1e-6, 1 - 1e-6, 0.1, 0.3, 0.999]])
    keep = (1 - rates).astype(np.float32)
    got = np.asarray(jax.jit(masks.keep_threshold_array)(keep))
    want = [masks.keep_threshold(1 - float(k)) for k in keep]
    np.testing.assert_array_equal(got, want)
    assert int(masks.keep_threshold_array(jnp.float32(1.5))) == 2**16  # clipped
    assert int(masks.keep_threshold_array(jnp.float32(-0.5))) == 0


def test_wide_multiply_matches_python_integers():
    a = jnp.array([0, 1, 2**16 - 1, 2**16, 2**31 + 5, 2**32 - 1], jnp.uint32)
    for c in [0, 1, 3, 2**16 + 3, 2**32 - 1, 2**32, 2**40 + 12345, 2**63 + 99, 2**64 - 1]:
        hi, lo = random.mul_wide(a, c)
        got = [(int(h) << 32) | int(w) for h, w in zip(hi, lo, strict=True)]
        assert got == [(int(v) * c) % 2**64 for v in a], c


def test_wide_counters_equal_narrow_counters():
    for shape in [(3, 5, 7), (2, 1, 9), (13,), (4, 4)]:
        hi, lo = random.counter_words(shape, wide=True)
        np.testing.assert_array_equal(lo, np.arange(np.prod(shape)).reshape(shape))
        assert not np.any(hi)
        np.testing.assert_array_equal(random.counter_words(shape)[1], lo)


def test_vmap_over_keys_equals_one_key_at_a_time():
    keys = unsplit.example_keys(jax.random.key(0), jnp.arange(4))
    batched = jax.vmap(lambda k: random.lanes16(k, (3, 8)))(keys)
    for i in range(4):
        np.testing.assert_array_equal(batched[i], random.lanes16(keys[i], (3, 8)))


def test_rbg_keys_are_refused():
    with pytest.raises(TypeError, match="'rbg' PRNG implementation; unsplit needs"):
        random.lanes16(jax.random.key(0, impl="rbg"), (4,))
    with pytest.raises(TypeError, match=r"must be a PRNG key made by jax.random.key\(seed\)"):
        random.lanes16(jnp.zeros(3, jnp.uint32), (4,))


# --- statistics (ideal bits fail each single check with probability ALPHA = 1e-7) ---


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9, 0.999])
def test_keep_fraction_is_binomial(rate):
    """Kept count ~ Binomial(n, T / 2**16); exact two-sided interval. False failure: 1e-7."""
    n = 2**20
    kept = int(jnp.sum(masks.keep_mask(jax.random.key(100), (n // 1024, 1024), rate)))
    p = masks.keep_threshold(rate) / 2**16
    low, high = stats.binom.interval(1 - ALPHA, n, p)
    assert low <= kept <= high, (kept, n * p)


@pytest.mark.parametrize("rate", [0.5, 0.3])
def test_four_lanes_of_a_block_are_independent(rate):
    """The 16 keep patterns of a block's four lanes vs their product law.

    Chi-square with 15 degrees of freedom (expected counts >= 2000, so the
    asymptotic law is accurate). False failure: 1e-7 per rate.
    """
    blocks = 2**18
    mask = np.asarray(masks.keep_mask(jax.random.key(200), (blocks, 4), rate))
    pattern = mask @ np.array([1, 2, 4, 8])
    observed = np.bincount(pattern, minlength=16)
    p = masks.keep_threshold(rate) / 2**16
    ones = np.array([bin(k).count("1") for k in range(16)])
    expected = blocks * p**ones * (1 - p) ** (4 - ones)
    statistic = float(np.sum((observed - expected) ** 2 / expected))
    assert statistic < stats.chi2.isf(ALPHA, 15), statistic


def _pair_statistic(a: np.ndarray, b: np.ndarray, p: float) -> float:
    """Chi-square (3 dof) of the four (a, b) keep cells vs independence with P(keep) = p."""
    cells = np.bincount(a.astype(int) * 2 + b.astype(int), minlength=4)
    probs = np.array([(1 - p) ** 2, (1 - p) * p, p * (1 - p), p**2])
    expected = a.size * probs
    return float(np.sum((cells - expected) ** 2 / expected))


def test_neighbours_are_independent():
    """Disjoint pairs (i, i + lag), lags inside a block, across blocks and a row apart.

    Seven chi-square checks (3 dof) at 1e-7 each: false failure <= 7e-7.
    """
    rate = 0.4
    p = masks.keep_threshold(rate) / 2**16
    flat = np.asarray(masks.keep_mask(jax.random.key(300), (2**20,), rate))
    for lag in [1, 2, 3, 4, 5, 8, 512]:
        usable = flat[: flat.size // (2 * lag) * (2 * lag)].reshape(-1, 2, lag)
        statistic = _pair_statistic(usable[:, 0].ravel(), usable[:, 1].ravel(), p)
        assert statistic < stats.chi2.isf(ALPHA, 3), (lag, statistic)


def test_examples_keys_give_independent_masks():
    """Masks of adjacent example ids, element by element. Three checks: false failure <= 3e-7."""
    rate = 0.5
    keys = unsplit.example_keys(jax.random.key(400), jnp.arange(4))
    drawn = np.asarray(jax.vmap(lambda k: masks.keep_mask(k, (512, 512), rate))(keys))
    for i in range(3):
        statistic = _pair_statistic(drawn[i].ravel(), drawn[i + 1].ravel(), 0.5)
        assert statistic < stats.chi2.isf(ALPHA, 3), (i, statistic)


def test_lane_values_are_uniform():
    """High and low bytes of the 16-bit lanes: chi-square, 255 dof each. False failure: 2e-7."""
    lanes = np.asarray(random.lanes16(jax.random.key(500), (2**20,)))
    for byte in (lanes >> 8, lanes & 0xFF):
        observed = np.bincount(byte, minlength=256)
        expected = lanes.size / 256
        statistic = float(np.sum((observed - expected) ** 2 / expected))
        assert statistic < stats.chi2.isf(ALPHA, 255), statistic


def test_grid_keep_mask_is_the_lanes_below_the_threshold():
    """The packed draw (attention's mask) has the bits of the grid lanes' compare."""
    data = random.key_data(jax.random.key(11))
    for shape in [(2, 3, 5, 7), (4, 8), (1, 6), (2, 2, 3, 12), (0, 4), (3, 0)]:
        lanes = random.grid_lanes16_from_data(data, shape)
        for threshold in [0, 1, 58982, 2**15, 2**16]:
            want = np.asarray(lanes) < threshold
            got = masks.grid_keep_mask_from_data(data, shape, np.uint32(threshold))
            assert got.dtype == jnp.bool_
            np.testing.assert_array_equal(got, want)
    traced = jax.jit(masks.grid_keep_mask_from_data, static_argnums=1)
    shape = (3, 9, 13)
    want = np.asarray(random.grid_lanes16_from_data(data, shape)) < 40000
    np.testing.assert_array_equal(traced(data, shape, jnp.uint32(40000)), want)


def test_flat_keep_mask_is_the_lanes_below_the_threshold():
    """The packed draw of the dropout layers has the bits of the flat lanes' compare."""
    data = random.key_data(jax.random.key(12))
    for shape in [(64, 128), (3, 5, 8), (4,), (6, 7), (5,), (), (0, 8)]:
        lanes = np.asarray(random.lanes16_from_data(data, shape))
        for threshold in [0, 1, 58982, 2**16]:
            got = masks.keep_mask_from_data(data, shape, np.uint32(threshold))
            assert got.dtype == jnp.bool_ and got.shape == shape
            np.testing.assert_array_equal(got, lanes < threshold)
