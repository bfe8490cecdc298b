"""The canonical tree across devices: exchanged pairwise, or gathered, the same bits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from unsplit._src.bitwise import reduce
from unsplit._src.bitwise.blocked import moves


def _rows(n):
    # Magnitudes far apart: the order of the adds shows in the last bits.
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 64)) * 10.0 ** rng.integers(-4, 5, size=(n, 1))).astype(np.float32)


def _mesh(n):
    auto = (jax.sharding.AxisType.Auto,)
    return jax.make_mesh((n,), ("g",), devices=jax.devices()[:n], axis_types=auto)


def _across(n, fn, rows):
    mesh = _mesh(n)
    run = jax.shard_map(fn, mesh=mesh, in_specs=P("g"), out_specs=P("g"), check_vma=False)
    return np.asarray(jax.jit(run)(rows)).reshape(n, -1)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_device_gets_the_canonical_trees_sum(n):
    rows = _rows(n)
    got = _across(n, lambda x: moves.pairwise_sum(x[0], ("g",), n)[None], rows)
    expected = np.asarray(reduce.combine({(i, 1): rows[i] for i in range(n)}, n, np.add))
    for device in range(n):
        np.testing.assert_array_equal(got[device], expected)
    if n > 2:  # Negative control: the rows added left to right give other bits.
        assert not np.array_equal(functools.reduce(np.add, rows), expected)


def test_pairwise_exchanges_beyond_the_gather_threshold():
    n = 8
    assert n > moves.GATHER_UP_TO
    mesh = _mesh(n)
    fn = jax.shard_map(
        lambda x: moves.pairwise_sum(x[0], ("g",), n)[None],
        mesh=mesh, in_specs=P("g"), out_specs=P("g"), check_vma=False,
    )  # fmt: skip
    hlo = jax.jit(fn).lower(jnp.asarray(_rows(n))).compile().as_text()
    assert "collective-permute" in hlo and "all-gather" not in hlo


def test_refuses_a_device_count_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        moves.pairwise_sum(jnp.ones(4), ("g",), 6)
