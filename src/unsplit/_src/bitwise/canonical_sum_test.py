"""``unsplit.canonical_sum``: totals with the same bits for every sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit

VALUES = jax.random.normal(jax.random.key(0), (4096, 3))


def sharded(x, devices):
    mesh = jax.make_mesh((devices,), ("data",))
    return jax.device_put(x, NamedSharding(mesh, P("data")))


def test_canonical_sum_has_the_same_bits_for_every_sharding():
    one = unsplit.canonical_sum({"m": VALUES})
    for devices in (2, 4, 8):
        assert unsplit.testing.bits_equal(
            unsplit.canonical_sum({"m": sharded(VALUES, devices)}), one
        )
    np.testing.assert_allclose(one["m"], np.sum(np.asarray(VALUES), axis=0), rtol=1e-5)


def test_negative_control_a_jitted_sum_follows_the_sharding():
    total = jax.jit(lambda x: jnp.sum(x, axis=0))
    one = total(VALUES)
    assert any(not unsplit.testing.bits_equal(total(sharded(VALUES, d)), one) for d in (2, 4, 8))


def test_per_example_aux_totals_of_a_bitwise_step_are_bit_identical_across_schedules():
    def loss_fn(w, x, key):
        h = jnp.tanh(jnp.where(jax.random.bernoulli(key, 0.9, x.shape), x, 0.0) @ w)
        return jnp.sum(h**2), {"correct": jnp.sum(h > 0).astype(jnp.float32), "h": jnp.sum(h)}

    w = jax.random.normal(jax.random.key(1), (3, 5))
    x = VALUES[:64]
    totals = []
    for devices in (None, 8):
        mesh = jax.make_mesh((devices,), ("data",)) if devices else None
        step = unsplit.value_and_grad(loss_fn, has_aux=True, mesh=mesh, bitwise=True)
        (_, aux), _ = step(w, x, jax.random.key(2))
        totals.append(unsplit.canonical_sum(aux))
    assert unsplit.testing.bits_equal(totals[0], totals[1])


def test_arrays_on_two_meshes_are_refused():
    a, b = sharded(VALUES, 2), sharded(VALUES, 4)
    with pytest.raises(ValueError, match=r"2 different meshes.*Fix"):
        unsplit.canonical_sum([a, b])
