"""Bitwise mode on users' layouts: tensor parallel, FSDP, both; and the jitted train step.

* tensor parallel: at a fixed model-parallel size (2), the bits are the same for
  every data-parallel degree (1, 2, 4) and microbatch count (every matrix's last
  dimension sharded, and Megatron's layout);
* FSDP (params sharded over the batch axis) gives the same bits as replicated
  params, and the grads come back with the params' shardings;
* ``bitwise_train_step``: 20 Adam steps, jitted and donated, end in the same bits
  on three schedules;
* FSDP groups (``chunk_axes``): the same bits for every data-parallel degree at the
  same devices per group, errors, and the warning for large gathered params;
* a 3-D (data, fsdp, model) mesh, FSDP and tensor parallel at once: AdamW through
  ``train_step`` ends where default mode does (with and without ``chunk_axes``), and in
  the same bits at data degree 1 and 2 with FSDP groups.
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import test_util as testing
from unsplit._src.bitwise import plan as plan_lib
from unsplit._src.bitwise import schedule as bitwise_schedule
from unsplit._src.bitwise.combine import scatter
from unsplit._src.models import transformer as tf

pytestmark = pytest.mark.xdist_group("bitwise")
KEY = jax.random.fold_in(jax.random.key(0), 11)
MODEL, PARAMS, BATCH = testing.problem()
WEIGHTED = tf.token_loss(MODEL)
AUTO = AxisType.Auto


def placed(mesh, specs):
    return testing.replicated(jax.tree.map(np.asarray, PARAMS), mesh, specs)


def run(mesh, params, microbatches=1):
    step = unsplit.value_and_grad(
        WEIGHTED, weighted=True, microbatches=microbatches, mesh=mesh, bitwise=True
    )
    return step(params, BATCH, KEY)


@functools.cache
def replicated_reference():
    return run(None, PARAMS)


@functools.cache
def tensor_parallel(data, microbatches=1):
    mesh = jax.make_mesh((data, 2), ("data", "model"), axis_types=(AUTO, AUTO))
    params = placed(mesh, testing.tensor_parallel_specs(PARAMS))
    return run(mesh, params, microbatches), params


@functools.cache
def megatron(data):
    mesh = jax.make_mesh((data, 2), ("data", "model"), axis_types=(AUTO, AUTO))
    return run(mesh, placed(mesh, testing.megatron_specs(PARAMS)))


@pytest.mark.slow  # the Python 3.12 fast subset leaves it out; ./dev test runs it
def test_megatron_tensor_parallel_bits_do_not_depend_on_the_data_parallel_degree():
    specs = jax.tree.leaves(testing.megatron_specs(PARAMS), is_leaf=lambda x: isinstance(x, P))
    assert sum("model" in s for s in specs) >= 8  # heads, MLP columns and rows are sharded
    assert testing.bits_equal(megatron(4), megatron(1))


@pytest.mark.parametrize("data,microbatches", [(2, 1), (4, 2), (1, 4)])
def test_tensor_parallel_bits_do_not_depend_on_the_data_parallel_degree(data, microbatches):
    out, params = tensor_parallel(data, microbatches)
    reference, _ = tensor_parallel(1)
    assert testing.bits_equal(out, reference)
    # Grads keep the params' tensor-parallel shardings.
    for g, p in zip(jax.tree.leaves(out[1]), jax.tree.leaves(params), strict=True):
        assert g.sharding == p.sharding
    # Close to the one-device bits; the model-parallel size may change the last bits.
    assert testing.rel_l2(out[1], replicated_reference()[1]) <= 1e-5


def test_fsdp_gives_the_bits_of_replicated_params():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AUTO, AUTO))
    specs = testing.fsdp_specs(PARAMS, "data", 4)
    params = placed(mesh, specs)
    assert any(p.sharding.spec != P() for p in jax.tree.leaves(params))  # some are sharded
    out = run(mesh, params, microbatches=2)
    assert testing.bits_equal(out, replicated_reference())
    for g, p in zip(jax.tree.leaves(out[1]), jax.tree.leaves(params), strict=True):
        assert g.sharding == p.sharding


@pytest.mark.slow  # the Python 3.12 fast subset leaves it out; ./dev test runs it
def test_fsdp_plus_tensor_parallel_gives_the_tensor_parallel_bits():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AUTO, AUTO))
    tp = testing.tensor_parallel_specs(PARAMS)
    fsdp = testing.fsdp_specs(PARAMS, "data", 4)

    def both(t, f):  # the first dimension over data, the last over model
        if len(t) >= 2 and f and f[0] == "data":
            return P("data", *t[1:])
        return t

    specs = jax.tree.map(both, tp, fsdp, is_leaf=lambda x: isinstance(x, P))
    out = run(mesh, placed(mesh, specs))
    assert testing.bits_equal(out, tensor_parallel(1)[0])


@pytest.mark.parametrize("data", [1, 4])
def test_explicit_axes_with_a_loss_that_names_its_output_sharding(data):
    # An Explicit mesh needs out_sharding on a contraction over a sharded dimension (as in
    # plain JAX); the MLP of the default-mode layout tests does that.
    mesh = jax.make_mesh((data, 2), ("data", "model"))
    specs = testing.MLP_LAYOUTS["tp"]
    host = testing.mlp_params()
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    step = unsplit.value_and_grad(testing.MLP_LOSSES[True], weighted=True, mesh=mesh, bitwise=True)
    out = step(params, testing.mlp_batch(), KEY)
    auto = jax.make_mesh((1, 2), ("data", "model"), axis_types=(AUTO, AUTO))
    auto_params = {k: jax.device_put(v, NamedSharding(auto, specs[k])) for k, v in host.items()}
    ref = unsplit.value_and_grad(testing.MLP_LOSSES[True], weighted=True, mesh=auto, bitwise=True)
    assert testing.rel_l2(out[1], ref(auto_params, testing.mlp_batch(), KEY)[1]) <= 1e-5
    assert out[1]["w1"].sharding == params["w1"].sharding


def test_a_dimension_over_both_a_batch_and_a_model_axis_is_refused():
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AUTO, AUTO))
    specs = jax.tree.map(
        lambda x: P(("data", "model")) if np.ndim(x) == 2 and np.shape(x)[0] % 4 == 0 else P(),
        PARAMS,
    )
    with pytest.raises(ValueError, match=r"sharded over both a batch axis and a model axis"):
        run(mesh, placed(mesh, specs))


@pytest.mark.slow  # the Python 3.12 fast subset leaves it out; ./dev test runs it
def test_twenty_adam_steps_through_the_jitted_donated_train_step_are_identical():
    # 50 steps across three schedules and 2 processes: processes/global_batch_test.py.
    steps = 20
    one = testing.train(steps, microbatches=4, devices=None, bitwise=True)
    eight = testing.train(steps, microbatches=1, devices=8, bitwise=True)
    four_by_two = testing.train(steps, microbatches=2, devices=4, bitwise=True)
    assert testing.bits_equal(eight, one)
    assert testing.bits_equal(four_by_two, one)
    assert testing.rel_l2(one, testing.problem()[1]) > 1e-3  # it trained


class _DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dropout(0.5, deterministic=False)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(2)(x)


@pytest.mark.parametrize("bitwise", [False, True])
def test_a_legacy_raw_key_gives_the_bits_of_the_wrapped_key_through_flax(bitwise):
    # jax.random.PRNGKey (uint32[2]), as Flax's examples make keys: each example's key is the
    # raw key data of example_keys in both modes (Flax takes it as a key), the bits those of
    # jax.random.wrap_key_data(raw).
    model = _DropoutMLP()
    params = model.init(jax.random.key(0), jnp.ones((4,)))
    batch = jax.random.normal(jax.random.key(1), (16, 4))
    seen = []

    def loss_fn(params, x, key):
        seen.append((key.shape, key.dtype))
        return jnp.sum(model.apply(params, x, rngs={"dropout": key}) ** 2)

    raw = jax.random.PRNGKey(3)
    wrapped = jax.random.wrap_key_data(raw)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AUTO,))

    def step(key, **kwargs):
        return unsplit.value_and_grad(loss_fn, bitwise=bitwise, **kwargs)(params, batch, key)

    out = step(raw)
    assert set(seen) == {((2,), np.dtype(np.uint32))}
    assert testing.bits_equal(out, step(wrapped))
    on_mesh = step(raw, mesh=mesh, microbatches=2)
    assert testing.bits_equal(on_mesh, step(wrapped, mesh=mesh, microbatches=2))
    if bitwise:  # and the raw key keeps bitwise mode's guarantee across schedules
        assert testing.bits_equal(on_mesh, out)
    # The noise is per example: the same as vmapping the loss over example_keys(raw, ids).
    keys = unsplit.example_keys(raw, jnp.arange(16))
    reference = jnp.mean(jax.vmap(loss_fn, in_axes=(None, 0, 0))(params, batch, keys))
    np.testing.assert_allclose(out[0], reference, rtol=1e-6)


# ---- FSDP groups: chunk_axes ----
# On a (data, fsdp=4) mesh with params sharded over ``fsdp`` and the batch over
# ``("data", "fsdp")``, ``chunk_axes="fsdp"`` gives the same bits for every
# data-parallel degree (data 1 and 2), microbatch count, and with ``fsdp`` the only
# batch axis (one group); close to default mode; grads keep the params' shardings.
# A group of another size may give other bits (documented in docs/bitwise.md, like
# another model-parallel layout): not tested.

GROUP_KEY = jax.random.fold_in(jax.random.key(0), 23)


def grouped_aux(params, example, key):
    loss_sum, weight = WEIGHTED(params, example, key)
    return (loss_sum, weight), loss_sum


def group_mesh(data, fsdp=4, names=("data", "fsdp")):
    devices = np.array(jax.devices()[: data * fsdp]).reshape(data, fsdp)
    return Mesh(devices, names, axis_types=(AUTO, AUTO))


def group_placed(mesh, axis="fsdp"):
    specs = testing.fsdp_specs(PARAMS, axis, mesh.shape[axis])
    return testing.replicated(jax.tree.map(np.asarray, PARAMS), mesh, specs)


@functools.cache
def group_run(data, microbatches=1, batch_axes=("data", "fsdp"), bitwise=True):
    mesh = group_mesh(data)
    params = group_placed(mesh)
    extra = {"bitwise": True, "chunk_axes": "fsdp"} if bitwise else {}
    step = unsplit.value_and_grad(
        grouped_aux,
        weighted=True,
        has_aux=True,
        microbatches=microbatches,
        mesh=mesh,
        batch_axes=batch_axes,
        **extra,
    )
    return step(params, BATCH, GROUP_KEY), params


GROUP_SCHEDULES = [(1, 1, ("data", "fsdp")), (1, 2, ("data", "fsdp")), (1, 1, "fsdp")]


@pytest.mark.parametrize("data,microbatches,batch_axes", GROUP_SCHEDULES)
def test_fsdp_group_bits_do_not_depend_on_the_data_parallel_degree(data, microbatches, batch_axes):
    reference, params = group_run(2)
    out, _ = group_run(data, microbatches, batch_axes)
    assert testing.bits_equal(out, reference)
    # Grads keep the params' FSDP shardings.
    assert any(p.sharding.spec[0] == "fsdp" for p in jax.tree.leaves(params))
    for g, p in zip(jax.tree.leaves(reference[1]), jax.tree.leaves(params), strict=True):
        assert g.sharding == p.sharding


def test_fsdp_groups_are_close_to_default_mode():
    (loss, aux), grads = group_run(2)[0]
    (d_loss, d_aux), d_grads = group_run(2, bitwise=False)[0]
    assert abs(float(loss) - float(d_loss)) <= 1e-5 * abs(float(d_loss))
    assert testing.rel_l2(grads, d_grads) <= 1e-5
    # aux in global-batch order, sharded like the batch.
    np.testing.assert_allclose(np.asarray(aux), np.asarray(d_aux), rtol=1e-5)
    assert aux.sharding.spec == P(("data", "fsdp"))


def test_a_chunk_size_that_is_not_a_multiple_of_the_group_is_refused():
    mesh = group_mesh(2)
    step = unsplit.value_and_grad(
        WEIGHTED, weighted=True, mesh=mesh, batch_axes=("data", "fsdp"), bitwise=True,
        chunk_axes="fsdp", chunk_size=6,
    )  # fmt: skip
    # The fix names chunk sizes that work here (12 is a multiple of 4 but does not divide a
    # group's 32 examples).
    with pytest.raises(
        ValueError, match=r"multiple of 4, got chunk_size=6.*chunk_size=4, 8, 16 or 32 here"
    ):
        step(group_placed(mesh), BATCH, GROUP_KEY)


def test_the_default_chunk_is_a_multiple_of_the_group():
    mesh = jax.make_mesh((1, 8), ("data", "fsdp"), axis_types=(AUTO, AUTO))
    step = unsplit.value_and_grad(
        WEIGHTED, weighted=True, mesh=mesh, batch_axes=("data", "fsdp"), bitwise=True,
        chunk_axes="fsdp",
    )  # fmt: skip
    assert step._engine.chunk(4 * 8) == 8
    assert step._engine.chunk(2 * 16) == 8
    assert step._engine.chunk(8 * 3) == 8  # the batch's default 8 already is


@pytest.mark.parametrize(
    "batch_axes,chunk_axes,match",
    [
        (("data",), "fsdp", r"subset of batch_axes=\('data',\).*not in batch_axes"),
        (("fsdp", "data"), "fsdp", r"last of the batch axes.*batch_axes=\('data', 'fsdp'\)"),
        (("data", "fsdp"), 3, r"mesh axis name or a tuple"),
        (
            ("data", "fsdp"),
            "fsdq",
            r"mesh does not have: \['fsdq'\] \(its axes: \('data', 'fsdp'\)\)",
        ),
    ],
)
def test_chunk_axes_must_be_the_last_batch_axes(batch_axes, chunk_axes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        unsplit.value_and_grad(
            WEIGHTED, mesh=group_mesh(2), batch_axes=batch_axes, bitwise=True, chunk_axes=chunk_axes
        )


def test_chunk_axes_need_bitwise_mode():
    # (batch_loss takes chunk_axes too: bitwise/coupled_test.py)
    with pytest.raises(ValueError, match="only applies with bitwise=True"):
        unsplit.value_and_grad(WEIGHTED, mesh=group_mesh(2), chunk_axes="fsdp",
                               batch_axes=("data", "fsdp"))  # fmt: skip


def test_large_gathered_params_warn_once_and_point_to_chunk_axes(monkeypatch):
    monkeypatch.setattr(bitwise_schedule, "GATHERED_WARN_BYTES", 1024)
    mesh = group_mesh(1)
    params = group_placed(mesh)
    batch = jax.tree.map(lambda x: x[:8], BATCH)
    step = unsplit.value_and_grad(
        WEIGHTED, weighted=True, mesh=mesh, batch_axes=("data", "fsdp"), bitwise=True,
        chunk_size=2,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="gathers the params.*chunk_axes='fsdp'"):
        step(params, batch, GROUP_KEY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(params, jax.tree.map(lambda x: x[:16], BATCH), GROUP_KEY)  # once per step
        grouped = unsplit.value_and_grad(
            WEIGHTED, weighted=True, mesh=mesh, batch_axes=("data", "fsdp"), bitwise=True,
            chunk_axes="fsdp", chunk_size=8,
        )  # fmt: skip
        grouped(params, batch, GROUP_KEY)  # params stay sharded: no warning


# ---- a 3-D (data, fsdp, model) mesh: FSDP and tensor parallel at once, train_step ----------

# The MLP's matrices sharded over fsdp (one dimension) and model (the other); the batch split
# over data and fsdp. The groups (fsdp x model with chunk_axes="fsdp") stay fixed while data
# changes.
SPECS_3D = {"w1": P("fsdp", "model"), "b1": P("model"), "w2": P("model", "fsdp"), "b2": P()}


def train_3d(data, options, steps=3):
    """Three AdamW steps of the MLP on a (data, 2, 2) mesh: the last loss and the params."""
    mesh = jax.make_mesh((data, 2, 2), ("data", "fsdp", "model"), devices=jax.devices()[: 4 * data])
    params = {
        k: jax.device_put(v, NamedSharding(mesh, SPECS_3D[k]))
        for k, v in testing.mlp_params().items()
    }
    optimizer = optax.adamw(1e-2)
    with jax.set_mesh(mesh):
        opt_state = optimizer.init(params)
    step = unsplit.value_and_grad(
        testing.MLP_LOSSES[False], mesh=mesh, batch_axes=("data", "fsdp"), **options
    )
    train = unsplit.train_step(step, optimizer)
    batch = testing.mlp_batch()
    for i in range(steps):
        loss, params, opt_state = train(params, opt_state, batch, jax.random.key(i))
    for k, v in params.items():
        assert v.sharding.is_equivalent_to(NamedSharding(mesh, SPECS_3D[k]), v.ndim), k
    return jax.device_get((loss, params))


@pytest.fixture(scope="module")
def default_3d():
    with jax.numpy_dtype_promotion("standard"):  # set up before the function's fixture
        return train_3d(2, {})


@pytest.mark.parametrize("chunk_axes", [None, "fsdp"], ids=["gathered", "fsdp_groups"])
@pytest.mark.usefixtures("standard_promotion")  # optax mixes Python floats and int32
@pytest.mark.xdist_group("mesh_3d")  # a group of its own: need not wait for "bitwise"
def test_bitwise_train_step_on_a_3d_mesh_matches_default_mode(default_3d, chunk_axes):
    bitwise = train_3d(2, {"bitwise": True, "chunk_size": 8, "chunk_axes": chunk_axes})
    for a, b in zip(jax.tree.leaves(bitwise), jax.tree.leaves(default_3d), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.usefixtures("standard_promotion")  # optax mixes Python floats and int32
@pytest.mark.xdist_group("mesh_3d")  # a group of its own: need not wait for "bitwise"
def test_bitwise_fsdp_groups_on_a_3d_mesh_give_the_same_bits_at_every_data_degree():
    options = {"bitwise": True, "chunk_size": 8, "chunk_axes": "fsdp"}
    assert testing.bits_equal(train_3d(1, options), train_3d(2, options))


@pytest.mark.parametrize("layout", ["fsdp", "tensor parallel"])
def test_every_leaf_in_a_vector_of_its_own_gives_the_same_bits(monkeypatch, layout):
    """Large leaves' params and sums travel as themselves (their FSDP grads never gathered):
    with every leaf counted large, the bits are those of the packed vectors."""
    monkeypatch.setattr(plan_lib, "_DIRECT_ELEMENTS", 1)
    if layout == "fsdp":
        mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
        params = placed(mesh, testing.fsdp_specs(PARAMS, "data", 8))
        out = run(mesh, params)
        assert testing.bits_equal(out, replicated_reference())
        step = unsplit.value_and_grad(WEIGHTED, weighted=True, mesh=mesh, bitwise=True)
        step(params, BATCH, KEY)
        (runner,) = step._engine._plans.values()
        assert scatter.SHARD in scatter.layouts(runner.plan) and runner.fused is not None
    else:
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AUTO, AUTO))
        params = placed(mesh, testing.tensor_parallel_specs(PARAMS))
        out = run(mesh, params)
        assert testing.bits_equal(out, tensor_parallel(1)[0])
    for g, p in zip(jax.tree.leaves(out[1]), jax.tree.leaves(params), strict=True):
        assert g.sharding == p.sharding
