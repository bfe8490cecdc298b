"""global_batch in one process: rows become a sharded global batch with position ids."""

import jax
import numpy as np
import pytest

import unsplit
from unsplit._src import test_util as testing
from unsplit._src.models import transformer as tf


def test_rows_become_a_sharded_global_batch_with_position_ids():
    mesh = jax.make_mesh((4,), ("data",))
    rows = {"x": np.arange(24, dtype=np.float32).reshape(8, 3), "y": np.arange(8)}
    batch, ids = unsplit.global_batch(rows, mesh)
    assert batch["x"].sharding.spec == jax.P("data")
    np.testing.assert_array_equal(np.asarray(batch["x"]), rows["x"])
    np.testing.assert_array_equal(np.asarray(ids), np.arange(8))


def test_record_ids_travel_with_their_rows_and_give_the_same_step():
    model, params, data = testing.problem()
    mesh = jax.make_mesh((2,), ("data",))
    records = np.arange(64, dtype=np.uint32) * 7 + 3
    batch, ids = unsplit.global_batch(data, mesh, local_ids=records)
    step = unsplit.value_and_grad(tf.token_loss(model), weighted=True, mesh=mesh)
    key = jax.random.key(1)
    _, grads = step(params, batch, key, ids=ids)
    _, direct = unsplit.value_and_grad(tf.token_loss(model), weighted=True)(
        params, data, key, ids=records
    )
    assert testing.rel_l2(grads, direct) <= 1e-5


def test_bad_local_ids():
    mesh = jax.make_mesh((2,), ("data",))
    rows = {"x": np.ones((4, 2), np.float32)}
    with pytest.raises(ValueError, match=r"local_ids must have shape \(4,\).*got shape \(3,\)"):
        unsplit.global_batch(rows, mesh, local_ids=np.arange(3))
    with pytest.raises(ValueError, match=r"non-negative"):
        unsplit.global_batch(rows, mesh, local_ids=np.array([0, 1, -2, 3]))
    with pytest.raises(ValueError, match=r"no array leaves"):
        unsplit.global_batch({}, mesh)


@pytest.mark.parametrize("bitwise", [False, True])
def test_64_bit_record_ids(bitwise):
    _, params, data = testing.problem()
    mesh = jax.make_mesh((2,), ("data",))
    records = np.arange(64, dtype=np.int64) + 2**40
    batch, ids = unsplit.global_batch(data, mesh, local_ids=records)
    assert isinstance(ids, unsplit.Ids64)
    key = jax.random.key(1)
    _, grads = unsplit.value_and_grad(
        testing.weighted_loss(), weighted=True, mesh=mesh, bitwise=bitwise
    )(params, batch, key, ids=ids)
    _, direct = unsplit.value_and_grad(testing.weighted_loss(), weighted=True, bitwise=bitwise)(
        params, data, key, ids=records
    )
    assert testing.rel_l2(grads, direct) <= 1e-5
