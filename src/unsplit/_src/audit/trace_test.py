"""trace.py: which arguments of a batched step are the batch, and resizing it."""

import jax
import jax.numpy as jnp
import pytest

from unsplit._src.audit import trace as audit_trace

KEY = jax.random.key(0)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((jnp.ones((4, 3)), {"x": jnp.ones((8, 3)), "y": jnp.ones(8)}, KEY), (1,)),
        ((jnp.ones((8, 3)),), (0,)),  # only the first argument: it is the batch
        (({"w": jnp.ones(3), "b": jnp.ones(())}, jnp.ones((8, 2)), jnp.ones(8)), (1, 2)),
        ((jnp.ones((4, 3)), jnp.ones((8, 3)), jnp.ones((5, 3)), jnp.ones((8, 1))), (1, 3)),
        (({"w": jnp.ones(())}, KEY), ()),
    ],
)
def test_infer_batch_argnums(args, expected):
    assert audit_trace.infer_batch_argnums(args) == expected


def test_resize_batch_grows_the_per_device_axis_of_a_stacked_leaf_and_keeps_shardings():
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    x = jax.device_put(jnp.ones((8, 3)), jax.NamedSharding(mesh, jax.P("d")))
    args = (jnp.ones(3), {"x": x, "stacked": jnp.ones((2, 4, 3))}, jnp.ones((2, 5)))
    out = audit_trace.resize_batch(args, (1,), 2, frozenset({"args[1]['stacked']"}))
    assert out[1]["x"].shape == (16, 3) and out[1]["x"].sharding == x.sharding
    assert out[1]["stacked"].shape == (2, 8, 3)
    assert out[0] is args[0] and out[2] is args[2]


def test_abstract_keeps_a_named_sharding_only_when_asked():
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    x = jax.device_put(jnp.ones((8, 3)), jax.NamedSharding(mesh, jax.P("d")))
    assert audit_trace.abstract(x).sharding is None
    assert audit_trace.abstract(x, keep_sharding=True).sharding == x.sharding
    assert audit_trace.abstract(jnp.ones(3), keep_sharding=True).sharding is None
