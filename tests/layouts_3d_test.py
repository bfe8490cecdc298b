"""A 3-D (data, fsdp, model) mesh: FSDP and tensor parallel at once, ``train_step`` in both modes.

The MLP's matrices are sharded over ``fsdp`` (one dimension) and ``model`` (the other);
the batch is split over ``data`` and ``fsdp``. Default mode and bitwise mode (with and
without ``chunk_axes="fsdp"``) train three AdamW steps to the same params (float
rounding); bitwise mode with FSDP groups ends in the same bits at data degree 1 and 2
(the group, fsdp x model, fixed).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit

SPECS = {"w1": P("fsdp", "model"), "b1": P("model"), "w2": P("model", "fsdp"), "b2": P()}
STEPS = 3
B, D, H, C = 32, 8, 16, 4


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": rng.normal(0, 0.3, (D, H)).astype(np.float32),
        "b1": np.zeros((H,), np.float32),
        "w2": rng.normal(0, 0.3, (H, C)).astype(np.float32),
        "b2": np.zeros((C,), np.float32),
    }


def _batch():
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(B, D)).astype(np.float32), "y": np.arange(B) % C}


def _loss(p, example, key):
    h = jax.nn.relu(example["x"] @ p["w1"] + p["b1"])
    h = unsplit.dropout(key, h, 0.2)
    # Tensor parallel on Explicit axes: the contraction over "model" needs its output sharding.
    logits = jnp.matmul(h, p["w2"], out_sharding=P()) + p["b2"]
    return -jax.nn.log_softmax(logits)[example["y"]]


@pytest.fixture(autouse=True)
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32
        yield


def _train(data, options):
    mesh = jax.make_mesh((data, 2, 2), ("data", "fsdp", "model"), devices=jax.devices()[: 4 * data])
    params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in _params().items()}
    optimizer = optax.adamw(1e-2)
    with jax.set_mesh(mesh):
        opt_state = optimizer.init(params)
    step = unsplit.value_and_grad(_loss, mesh=mesh, batch_axes=("data", "fsdp"), **options)
    train = unsplit.train_step(step, optimizer)
    batch = _batch()
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
