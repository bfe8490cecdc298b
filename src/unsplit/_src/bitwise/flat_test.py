import jax
import jax.numpy as jnp
import numpy as np

from unsplit._src.bitwise.flat import FlatPlan


def _leaves():
    rng = np.random.default_rng(0)
    return [
        jnp.asarray(rng.normal(size=(3, 5)), jnp.float32),
        jnp.asarray(rng.normal(size=(7,)), jnp.float32),
        jnp.arange(4, dtype=jnp.int32),
        jnp.asarray(rng.normal(size=(16, 2)), jnp.float32),
        jnp.zeros((0,), jnp.float32),
        jax.random.key(3),
    ]


def test_pack_is_the_concatenation_of_the_raveled_leaves_bit_for_bit():
    leaves = _leaves()
    plan = FlatPlan.of(leaves)
    packed = jax.jit(plan.pack)(leaves)
    floats = jnp.concatenate([leaves[0].ravel(), leaves[1].ravel(), leaves[3].ravel()])
    keys = jax.random.key_data(leaves[5]).ravel()
    np.testing.assert_array_equal(packed[0].view(np.uint32), np.asarray(floats).view(np.uint32))
    np.testing.assert_array_equal(packed[1], leaves[2])
    np.testing.assert_array_equal(packed[2], keys)
    back = plan.unpack(packed)
    for a, b in zip(back[:5], leaves[:5], strict=True):
        np.testing.assert_array_equal(a, b)
    assert jnp.array_equal(jax.random.key_data(back[5]), jax.random.key_data(leaves[5]))


def test_pack_keeps_negative_zeros_nans_and_infinities():
    x = jnp.array([-0.0, jnp.nan, jnp.inf, -jnp.inf, 1e-45], jnp.float32)
    plan = FlatPlan.of([x, x[:2]])
    (packed,) = jax.jit(plan.pack)([x, x[:2]])
    want = np.concatenate([np.asarray(x), np.asarray(x[:2])]).view(np.uint32)
    np.testing.assert_array_equal(np.asarray(packed).view(np.uint32), want)


def test_the_compiled_pack_has_no_concatenate_of_its_computed_parts():
    # XLA:CPU emits a concatenate fused with its producers as one loop that evaluates
    # every operand at every output element (a chunk program's pack took 10x its dots);
    # the pack puts each part in place instead. Negative control: jnp.concatenate.
    def parts(a, b):
        return [jnp.sum(a * a, axis=0), (b * 2.0).T.ravel(), jnp.tanh(a).ravel()]

    a, b = jnp.ones((8, 64)), jnp.ones((32, 16))
    plan = FlatPlan.of(parts(a, b))
    ours = jax.jit(lambda a, b: plan.pack(parts(a, b))).lower(a, b).compile().as_text()
    naive = jax.jit(lambda a, b: jnp.concatenate(parts(a, b))).lower(a, b).compile().as_text()
    assert " concatenate(" in naive
    assert " concatenate(" not in ours


def test_pack_of_arrays_typed_on_an_explicit_mesh():
    # Shardings in types: the parts are concatenated (an update-slice into a new zero vector
    # would mix that mesh with none).
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, jax.P()))
    y = jax.device_put(jnp.ones((2, 3)), jax.NamedSharding(mesh, jax.P()))
    plan = FlatPlan.of([x, y])
    with jax.set_mesh(mesh):
        (packed,) = jax.jit(plan.pack)([x, y])
    np.testing.assert_array_equal(packed, np.concatenate([np.arange(8.0), np.ones(6)]))


def test_an_array_alone_is_its_own_vector_packed_without_a_copy():
    leaves = _leaves()
    alone = [False, False, False, True, False, False]
    plan = FlatPlan.of(leaves, alone=alone, multiple=8)
    packed = jax.jit(plan.pack)(leaves)
    # In order of first use: the shared floats (padded to 8: 22 -> 24), ints, the one alone, keys.
    assert [v.shape for v in packed] == [(24,), (8,), (32,), (8,)]
    np.testing.assert_array_equal(packed[2], leaves[3].ravel())
    for a, b in zip(plan.unpack(packed)[:5], leaves[:5], strict=True):
        np.testing.assert_array_equal(a, b)
    # Its pack and unpack are reshapes: no copy into a zero vector.
    jaxpr = str(jax.make_jaxpr(lambda x: FlatPlan.of([x], alone=[True]).pack([x]))(leaves[3]))
    assert "dynamic_update_slice" not in jaxpr and "concatenate" not in jaxpr
