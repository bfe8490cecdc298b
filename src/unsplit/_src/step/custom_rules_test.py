"""A loss's custom derivative rules run in both modes, also where its shardings are moved.

Each rule here is not its primal's derivative (it scales the gradient), so a step that
differentiated the primal instead would give other grads than the plain jitted step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import test_util as tu
from unsplit._src.step import custom_rules

KEY = jax.random.key(5)
B = 8


def _mesh(types):
    return jax.make_mesh((2, 4), ("data", "seq"), axis_types=(types,) * 2)


def _step(loss, mesh, bitwise):
    options = {"chunk_size": 2} if bitwise else {}
    step = unsplit.value_and_grad(loss, mesh=mesh, bitwise=bitwise, **options)
    with jax.set_mesh(mesh):
        return jax.device_get(step(tu.ring_params(), tu.ring_batch(B), KEY))


def _plain(loss, mesh):
    """The same step as a plain jitted step on the mesh: the user's rules run there."""
    batch = tu.ring_batch(B)
    keys = unsplit.example_keys(KEY, jnp.arange(B, dtype=jnp.uint32))

    def batched(p, b, k):
        return jnp.mean(jax.vmap(loss, in_axes=(None, 0, 0))(p, b, k))

    with jax.set_mesh(mesh):
        where = NamedSharding(mesh, P("data"))
        b, k = jax.device_put(batch, where), jax.device_put(keys, where)
        return jax.device_get(jax.jit(jax.value_and_grad(batched))(tu.ring_params(), b, k))


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def _doubled_grad(calls):
    @jax.custom_vjp
    def identity(x):
        return x

    def bwd(_, g):
        calls.append("bwd")
        return (2 * g,)

    identity.defvjp(lambda x: (x, None), bwd)
    return identity


def _annotated_loss(rule, spelling):
    def loss(p, example, key):
        h = jnp.tanh(example["x"] @ p["q"])
        if spelling == "reshard":
            h = jax.sharding.reshard(h, P("seq", None))
        else:
            h = jax.lax.with_sharding_constraint(h, P("seq", None))
        h = rule(h)
        return jnp.mean(jnp.tanh(h @ p["o"]) ** 2) + 0 * jax.random.uniform(key)

    return loss


@pytest.mark.parametrize("bitwise", [False, True], ids=["default", "bitwise"])
@pytest.mark.parametrize(
    ("types", "spelling"), [(AxisType.Auto, "wsc"), (AxisType.Explicit, "reshard")]
)
def test_a_custom_vjp_rule_beside_sharding_annotations_runs(types, spelling, bitwise):
    mesh = _mesh(types)
    calls = []
    loss = _annotated_loss(_doubled_grad(calls), spelling)
    out = _step(loss, mesh, bitwise)
    assert "bwd" in calls
    _close(out, _plain(loss, mesh))
    _, primal_grads = _plain(_annotated_loss(lambda h: h, spelling), mesh)
    np.testing.assert_allclose(out[1]["q"], 2 * primal_grads["q"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bitwise", [False, True], ids=["default", "bitwise"])
def test_a_ring_attentions_own_backward_pass_runs_inside_its_region(bitwise):
    mesh = _mesh(AxisType.Explicit)
    calls = []
    loss = tu.ring_loss(tu.toy_ring_with_rule(calls, scale=2.0), mesh, "reshard")
    out = _step(loss, mesh, bitwise)
    assert "bwd" in calls
    _close(out, _plain(loss, mesh))
    primal = _plain(tu.ring_loss(tu.toy_ring, mesh, "reshard"), mesh)
    assert not np.allclose(out[1]["q"], primal[1]["q"], rtol=1e-3)  # the rule's, not the ring's


@pytest.mark.parametrize("bitwise", [False, True], ids=["default", "bitwise"])
def test_a_custom_jvp_rule_inside_a_region_runs(bitwise):
    mesh = _mesh(AxisType.Explicit)

    @jax.custom_jvp
    def tripled_tangent(x):
        return x

    tripled_tangent.defjvp(lambda primals, tangents: (primals[0], 3 * tangents[0]))

    def attention(q, k, v):
        return tu.toy_ring(tripled_tangent(q), k, v)

    loss = tu.ring_loss(attention, mesh, "reshard")
    _close(_step(loss, mesh, bitwise), _plain(loss, mesh))


def test_a_trace_outside_a_manual_region_keeps_the_callers_jax_settings():
    mesh = _mesh(AxisType.Explicit)
    seen = []

    def body(x):
        seen.append(custom_rules.outside_manual(lambda: jax.config.jax_numpy_dtype_promotion))
        return x

    region = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())
    with jax.numpy_dtype_promotion("standard"), jax.set_mesh(mesh):
        jax.make_jaxpr(region)(np.ones(2, np.float32))
    assert seen == ["standard"]  # the tests run "strict" elsewhere
