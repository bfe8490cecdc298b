"""Default mode on users' layouts: params keep their shardings, results match one device.

Grid: layouts {replicated, FSDP over the batch axis, tensor parallel over a
model axis, both} x schedules {1 device, 8 devices, 4 devices x 2
microbatches, 2 x 4} x {weighted, unweighted} x {Explicit, Auto} axes. Every
case matches the one-device reference within 1e-5 relative L2 and returns
grads sharded exactly like the params.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import test_util as testing

KEY = jax.random.fold_in(jax.random.key(0), 3)
D, H, C, B = testing.MLP_SIZES  # input, hidden, classes, batch
TOL = 1e-5
init_params, make_batch, mlp_loss = testing.mlp_params, testing.mlp_batch, testing.mlp_loss
LOSSES, LAYOUTS = testing.MLP_LOSSES, testing.MLP_LAYOUTS

# (data-parallel devices, microbatches); with a model axis the mesh is (data, model=2).
SCHEDULES = [(1, 1), (8, 1), (4, 2), (2, 4)]


@functools.cache
def reference(weighted):
    return unsplit.value_and_grad(LOSSES[weighted], weighted=weighted)(
        init_params(), make_batch(), KEY
    )


def mesh_for(layout, data, axis_type):
    model = 2 if "tp" in layout else 1
    if data * model > 8:
        data = 8 // model
    return jax.make_mesh((data, model), ("data", "model"), axis_types=(axis_type, axis_type))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("data,microbatches", SCHEDULES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_params_match_one_device_and_keep_their_shardings(
    layout, data, microbatches, weighted, axis_type
):
    mesh = mesh_for(layout, data, axis_type)
    specs = LAYOUTS[layout]
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in init_params().items()}
    step = unsplit.value_and_grad(
        LOSSES[weighted], weighted=weighted, microbatches=microbatches, mesh=mesh
    )
    loss, grads = step(params, make_batch(), KEY)
    ref_loss, ref_grads = reference(weighted)
    assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))
    assert testing.rel_l2(grads, ref_grads) <= TOL
    for name, g in grads.items():
        assert g.sharding == params[name].sharding, name


def flops(compiled):
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("layout", ["replicated", "tp"])
def test_the_step_compiles_to_the_plain_steps_flops(layout, weighted):
    # What a user writes without unsplit, drawing the same per-example keys: the step
    # must not add work to it (e.g. a pass over the grads after the backward pass).
    wide = {"w1": (D, 256), "b1": (256,), "w2": (256, C), "b2": (C,)}
    params = {k: np.full(shape, 0.01, np.float32) for k, shape in wide.items()}
    mesh = mesh_for(layout, 4, AxisType.Auto)
    params = {
        k: jax.device_put(v, NamedSharding(mesh, LAYOUTS[layout][k])) for k, v in params.items()
    }
    batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))

    def plain_loss(p, rows, key):
        keys = unsplit.example_keys(key, jnp.arange(B))
        out = jax.vmap(LOSSES[weighted], in_axes=(None, 0, 0))(p, rows, keys)
        return jnp.sum(out[0]) / jnp.sum(out[1]) if weighted else jnp.mean(out)

    plain = jax.jit(jax.value_and_grad(plain_loss)).lower(params, batch, KEY).compile()
    step = unsplit.value_and_grad(LOSSES[weighted], weighted=weighted, mesh=mesh)
    ours = step.lower(params, batch, KEY).compile()
    assert flops(ours) <= 1.002 * flops(plain), (flops(ours), flops(plain))


@pytest.mark.parametrize(
    "layout,weighted", [("fsdp", True), ("fsdp+tp", True), ("replicated", False)]
)
def test_the_step_gives_the_plain_steps_bits(layout, weighted):
    # Default mode's rounding is the plain jitted step's: on each layout, the grads equal
    # those of jax.jit(jax.value_and_grad(...)) over the same per-example keys, bit for bit.
    # So whatever drift two schedules show over a run (docs/rule.md, "Float rounding across
    # schedules"), the user's own step with the same shardings shows it too.
    mesh = mesh_for(layout, 8, AxisType.Auto)
    specs = LAYOUTS[layout]
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in init_params().items()}
    batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))

    def plain_loss(p, rows, key):
        keys = unsplit.example_keys(key, jnp.arange(B))
        out = jax.vmap(LOSSES[weighted], in_axes=(None, 0, 0))(p, rows, keys)
        return jnp.sum(out[0]) / jnp.sum(out[1]) if weighted else jnp.mean(out)

    shardings = {k: v.sharding for k, v in params.items()}
    plain = jax.jit(jax.value_and_grad(plain_loss), out_shardings=(None, shardings))
    plain_loss_value, plain_grads = plain(params, batch, KEY)
    loss, grads = unsplit.value_and_grad(LOSSES[weighted], weighted=weighted, mesh=mesh)(
        params, batch, KEY
    )
    assert np.asarray(loss) == np.asarray(plain_loss_value)
    for name in grads:
        np.testing.assert_array_equal(np.asarray(grads[name]), np.asarray(plain_grads[name]))


def test_negative_control_per_device_keys_do_differ():
    # The same layout with one key per device (shard_prng_key) is another computation.
    batch, params = make_batch(), init_params()

    def per_device(p, key_index):
        keys = jax.random.split(KEY, 8)
        shard = jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:])[key_index], batch)
        inner = jax.random.split(keys[key_index], shard["x"].shape[0])
        losses, weights = jax.vmap(LOSSES[True], in_axes=(None, 0, 0))(p, shard, inner)
        return jnp.sum(losses), jnp.sum(weights)

    def total(p):
        sums = [per_device(p, i) for i in range(8)]
        return sum(s for s, _ in sums) / sum(w for _, w in sums)

    naive = jax.grad(total)(params)
    assert testing.rel_l2(naive, reference(True)[1]) > 100 * TOL


def test_params_from_another_mesh_are_moved_with_a_warning():
    four = jax.make_mesh((4,), ("data",))
    two = jax.sharding.Mesh(np.array(jax.devices()[4:6]), ("data",))
    params = {k: jax.device_put(v, NamedSharding(four, P())) for k, v in init_params().items()}
    step = unsplit.value_and_grad(LOSSES[True], weighted=True, mesh=two)
    with pytest.warns(UserWarning, match=r"params\['b1'\] is not placed on the step's mesh"):
        _, grads = step(params, make_batch(), KEY)
    assert testing.rel_l2(grads, reference(True)[1]) <= TOL
    assert grads["w1"].sharding.mesh == two


def test_a_key_or_ids_committed_outside_the_mesh_are_moved_with_a_warning():
    # They gave JAX's "incompatible devices" error; params and batch were already moved.
    mesh = jax.make_mesh((4,), ("data",))
    step = unsplit.value_and_grad(LOSSES[True], weighted=True, mesh=mesh)
    params, batch = init_params(), make_batch()
    expected = step(params, batch, KEY)
    outside = jax.devices()[6]
    with pytest.warns(UserWarning, match=r"key is not placed on the step's mesh"):
        moved_key = step(params, batch, jax.device_put(KEY, outside))
    ids = jax.device_put(jnp.arange(B), outside)
    with pytest.warns(UserWarning, match=r"ids is not placed on the step's mesh"):
        moved_ids = step(params, batch, KEY, ids=ids)
    assert testing.bits_equal(moved_key, expected) and testing.bits_equal(moved_ids, expected)


def test_params_on_one_device_inside_or_outside_the_mesh_work():
    mesh = jax.make_mesh((4,), ("data",))
    step = unsplit.value_and_grad(LOSSES[True], weighted=True, mesh=mesh)
    inside = jax.device_put(init_params(), jax.devices()[2])
    with pytest.warns(UserWarning, match=r"params\['b1'\] is not placed on the step's mesh"):
        _, grads = step(inside, make_batch(), KEY)
    assert testing.rel_l2(grads, reference(True)[1]) <= TOL
    assert grads["w1"].sharding == NamedSharding(mesh, P())
    step(inside, make_batch(), KEY)  # warned once per step, not every call
    outside = jax.device_put(init_params(), jax.devices()[6])
    fresh = unsplit.value_and_grad(LOSSES[True], weighted=True, mesh=mesh)
    with pytest.warns(UserWarning, match=r"not placed on the step's mesh"):
        _, grads = fresh(outside, make_batch(), KEY)
    assert testing.rel_l2(grads, reference(True)[1]) <= TOL


def test_batch_axes_tuple_splits_over_two_axes():
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "model"))
    step = unsplit.value_and_grad(
        LOSSES[True], weighted=True, microbatches=2, mesh=mesh, batch_axes=("a", "b")
    )
    assert step.num_devices == 4
    _, grads = step(init_params(), make_batch(), KEY)
    assert testing.rel_l2(grads, reference(True)[1]) <= TOL
