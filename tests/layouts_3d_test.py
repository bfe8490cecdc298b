"""A 3-D (data, fsdp, model) mesh: FSDP and tensor parallel at once, ``train_step`` in both modes.

The MLP's matrices are sharded over ``fsdp`` (one dimension) and ``model`` (the other);
the batch is split over ``data`` and ``fsdp``. Default mode and bitwise mode (with and
without ``chunk_axes="fsdp"``) train three AdamW steps to the same params (float
rounding); bitwise mode with FSDP groups ends in the same bits at data degree 1 and 2
(the group, fsdp x model, fixed).
"""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import test_util

SPECS = {"w1": P("fsdp", "model"), "b1": P("model"), "w2": P("model", "fsdp"), "b2": P()}
STEPS = 3


@pytest.fixture(autouse=True)
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32
        yield


def _train(data, options):
    mesh = jax.make_mesh((data, 2, 2), ("data", "fsdp", "model"), devices=jax.devices()[: 4 * data])
    params = {
        k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
        for k, v in test_util.mlp_params().items()
    }
    optimizer = optax.adamw(1e-2)
    with jax.set_mesh(mesh):
        opt_state = optimizer.init(params)
    step = unsplit.value_and_grad(
        test_util.MLP_LOSSES[False], mesh=mesh, batch_axes=("data", "fsdp"), **options
    )
    train = unsplit.train_step(step, optimizer)
    batch = test_util.mlp_batch()
    for i in range(STEPS):
        loss, params, opt_state = train(params, opt_state, batch, jax.random.key(i))
    for k, v in params.items():
        assert v.sharding.is_equivalent_to(NamedSharding(mesh, SPECS[k]), v.ndim), k
    return jax.device_get((loss, params))


@pytest.fixture(scope="module")
def default_run():
    with jax.numpy_dtype_promotion("standard"):
        return _train(2, {})


@pytest.mark.parametrize("chunk_axes", [None, "fsdp"], ids=["gathered", "fsdp_groups"])
def test_bitwise_train_step_matches_default_mode(default_run, chunk_axes):
    bitwise = _train(2, {"bitwise": True, "chunk_size": 8, "chunk_axes": chunk_axes})
    for a, b in zip(jax.tree.leaves(bitwise), jax.tree.leaves(default_run), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bitwise_fsdp_groups_same_bits_at_every_data_degree():
    options = {"bitwise": True, "chunk_size": 8, "chunk_axes": "fsdp"}
    one, two = _train(1, options), _train(2, options)
    assert unsplit.testing.bits_equal(one, two)
