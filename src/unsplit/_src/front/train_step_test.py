"""train_step: two trees or a Flax TrainState, both modes, the same bits, compiled once."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import test_util

pytestmark = pytest.mark.usefixtures("standard_promotion")  # optax mixes floats and int32
KEY = jax.random.key(3)
X = test_util.tiny_batch()
loss_fn, init = test_util.tiny_loss, test_util.tiny_params


def counting(optimizer, traces):
    """``optimizer`` with a Python counter of how often its update is traced."""

    def update(grads, state, params=None):
        traces.append(1)
        return optimizer.update(grads, state, params)

    return optax.GradientTransformation(optimizer.init, update)


def run_trees(step, optimizer, steps, batch=X):
    params = init()
    opt_state = optimizer.init(params)
    train = unsplit.train_step(step, optimizer)
    for i in range(steps):
        loss, params, opt_state = train(params, opt_state, batch, jax.random.fold_in(KEY, i))
    return loss, params, opt_state


def run_state(step, optimizer, steps, batch=X):
    state = train_state.TrainState.create(apply_fn=None, params=init(), tx=optimizer)
    train = unsplit.train_step(step)
    for i in range(steps):
        loss, state = train(state, batch, jax.random.fold_in(KEY, i))
    return loss, state


@pytest.mark.parametrize("bitwise", [False, True])
def test_a_train_state_gives_the_bits_of_the_two_trees_and_counts_steps(bitwise):
    step = unsplit.value_and_grad(loss_fn, microbatches=2, bitwise=bitwise)
    optimizer = optax.adamw(1e-2)
    loss, params, opt_state = run_trees(step, optimizer, 3)
    state_loss, state = run_state(step, optimizer, 3)
    assert unsplit.testing.bits_equal((state_loss, state.params, state.opt_state),
                                      (loss, params, opt_state))  # fmt: skip
    assert int(state.step) == 3
    # What Flax's own loop computes: apply_gradients with the step's grads.
    reference = train_state.TrainState.create(apply_fn=None, params=init(), tx=optimizer)
    for i in range(3):
        _, grads = step(reference.params, X, jax.random.fold_in(KEY, i))
        reference = reference.apply_gradients(grads=grads)
    np.testing.assert_allclose(state.params["a"], reference.params["a"], rtol=1e-6)


def test_a_bitwise_train_state_run_is_the_same_on_one_device_and_eight():
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    one = run_state(
        unsplit.value_and_grad(loss_fn, microbatches=4, bitwise=True, chunk_size=2), optimizer, 3
    )
    mesh = jax.make_mesh((8,), ("data",))
    eight = run_state(
        unsplit.value_and_grad(loss_fn, mesh=mesh, bitwise=True, chunk_size=2), optimizer, 3
    )
    assert unsplit.testing.bits_equal(
        (one[0], one[1].params, one[1].opt_state), (eight[0], eight[1].params, eight[1].opt_state)
    )
    assert unsplit.testing.rel_l2(one[1].params, init()) > 1e-3  # it trained


@pytest.mark.parametrize("bitwise", [False, True])
def test_the_update_is_traced_once(bitwise):
    traces = []
    optimizer = counting(optax.adam(1e-2), traces)
    step = unsplit.value_and_grad(loss_fn, bitwise=bitwise)
    run_state(step, optimizer, 3)
    assert len(traces) == 1
    traces.clear()
    run_trees(step, optimizer, 3)
    assert len(traces) == 1


def test_a_train_state_with_another_optimizer_is_refused():
    step = unsplit.value_and_grad(loss_fn)
    state = train_state.TrainState.create(apply_fn=None, params=init(), tx=optax.sgd(0.1))
    train = unsplit.train_step(step, optax.adam(1e-3))
    with pytest.raises(ValueError, match=r"TrainState has another tx.*Fix: pass one of them"):
        train(state, X, KEY)


def test_without_an_optimizer_two_trees_are_refused_with_the_fix():
    train = unsplit.train_step(unsplit.value_and_grad(loss_fn))
    params = init()
    with pytest.raises(TypeError, match=r"made without an optimizer.*got dict.*Fix: unsplit"):
        train(params, optax.sgd(0.1).init(params), X, KEY)


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match=r"step must be made by unsplit.value_and_grad"):
        unsplit.train_step(loss_fn, optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"optimizer must be an optax.GradientTransformation"):
        unsplit.train_step(unsplit.value_and_grad(loss_fn), "adam")
    train = unsplit.train_step(unsplit.value_and_grad(loss_fn))
    state = train_state.TrainState.create(apply_fn=None, params=init(), tx=optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"train\(state, batch, key, ids=None\)"):
        train(state, X)


# ---- the optimizer update inside the bitwise guarantee: FSDP, any optax transformation ----

SIZES = (8, 64, 64, 64, 4)  # a 4-layer MLP


def mlp_init():
    keys = jax.random.split(jax.random.key(5), len(SIZES) - 1)
    return {
        f"w{i}": jax.random.normal(k, (a, b)) / np.sqrt(a)
        for i, (k, a, b) in enumerate(zip(keys, SIZES[:-1], SIZES[1:], strict=True))
    }


def mlp_loss(params, x, key):
    h = x
    for i in range(len(SIZES) - 1):
        h = h @ params[f"w{i}"]
        if i < len(SIZES) - 2:
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, h.shape)
            h = jnp.where(keep, jax.nn.relu(h) / 0.9, 0.0)
    return jnp.sum(h**2)


MLP_X = jax.random.normal(jax.random.key(6), (32, SIZES[0]))


def fsdp(params, mesh):
    """Each matrix sharded over the batch axis on its first dimension (FSDP)."""
    return {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in params.items()}


def run_mlp(optimizer, devices, microbatches=1, layout="fsdp", steps=3):
    mesh = jax.make_mesh((devices,), ("data",)) if devices else None
    step = unsplit.value_and_grad(
        mlp_loss, mesh=mesh, microbatches=microbatches, bitwise=True, chunk_size=4
    )
    params = mlp_init()
    if mesh is not None and layout == "fsdp":
        params = fsdp(params, mesh)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        opt_state = optimizer.init(params)  # Explicit axes: as plain JAX, inside the mesh
    train = unsplit.train_step(step, optimizer)
    for i in range(steps):
        _, params, opt_state = train(params, opt_state, MLP_X, jax.random.fold_in(KEY, i))
    return params, opt_state


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(optax.cosine_decay_schedule(1e-2, 10), weight_decay=1e-2),
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
    "lamb": lambda: optax.lamb(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp_runs_end_in_the_same_bits_for_every_data_parallel_degree(name):
    one = run_mlp(OPTIMIZERS[name](), None, microbatches=2)
    eight = run_mlp(OPTIMIZERS[name](), 8)
    assert unsplit.testing.bits_equal(jax.device_get(eight), jax.device_get(one))
    assert unsplit.testing.rel_l2(one[0], mlp_init()) > 1e-4  # it trained
    # The params keep their FSDP shardings.
    assert eight[0]["w1"].sharding.spec == P("data")


@pytest.mark.slow
def test_adamw_fsdp_grid_of_schedules_is_bit_identical():
    optimizer = OPTIMIZERS["clip+adamw"]
    reference = jax.device_get(run_mlp(optimizer(), None))
    for devices, microbatches, layout in [(2, 1, "fsdp"), (4, 2, "fsdp"), (8, 1, "fsdp"),
                                          (8, 1, "replicated"), (1, 4, "fsdp")]:  # fmt: skip
        got = jax.device_get(run_mlp(optimizer(), devices, microbatches, layout))
        assert unsplit.testing.bits_equal(got, reference), (devices, microbatches, layout)


def test_negative_control_a_jitted_update_on_fsdp_shards_changes_the_bits():
    # The same grads (bitwise), updated by the usual jitted optax update on FSDP shards.
    optimizer = optax.adafactor(1e-2, min_dim_size_to_factor=8)
    params = mlp_init()
    _, grads = unsplit.value_and_grad(mlp_loss, bitwise=True, chunk_size=4)(params, MLP_X, KEY)

    @jax.jit
    def update(params, grads):
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return optax.apply_updates(params, updates)

    one = update(params, grads)
    differ = []
    for devices in (2, 8):
        mesh = jax.make_mesh((devices,), ("data",))
        with jax.set_mesh(mesh):
            sharded = update(fsdp(params, mesh), fsdp(grads, mesh))
        differ.append(not unsplit.testing.bits_equal(jax.device_get(sharded), one))
    assert any(differ)


@pytest.mark.parametrize("name", ["clip+adamw", "adafactor"])
def test_tensor_parallel_runs_end_in_the_same_bits_for_every_data_parallel_degree(name):
    from unsplit._src import test_util

    auto = (jax.sharding.AxisType.Auto,) * 2
    results = []
    for data in (1, 2, 4):
        mesh = jax.make_mesh((data, 2), ("data", "model"), axis_types=auto)
        specs = test_util.MLP_LAYOUTS["tp"]
        params = {
            k: jax.device_put(v, NamedSharding(mesh, specs[k]))
            for k, v in test_util.mlp_params().items()
        }
        optimizer = OPTIMIZERS[name]()
        opt_state = optimizer.init(params)
        step = unsplit.value_and_grad(
            test_util.MLP_LOSSES[True], weighted=True, mesh=mesh, bitwise=True
        )
        train = unsplit.train_step(step, optimizer)
        batch = test_util.mlp_batch()
        for i in range(3):
            _, params, opt_state = train(params, opt_state, batch, jax.random.fold_in(KEY, i))
        assert params["w1"].sharding.spec == specs["w1"]  # the layout is kept
        results.append(jax.device_get((params, opt_state)))
    assert all(unsplit.testing.bits_equal(r, results[0]) for r in results[1:])


@pytest.mark.parametrize("bitwise", [False, True])
def test_out_of_memory_on_the_first_call_gets_the_modes_hint(monkeypatch, bitwise):
    step = unsplit.value_and_grad(loss_fn, microbatches=2, bitwise=bitwise)

    def exhausted(*args, **kwargs):  # as a compile or a transfer of the first call reports it
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB")

    monkeypatch.setattr(step._inputs, "check", exhausted)
    optimizer = optax.sgd(0.1)
    train = unsplit.train_step(step, optimizer)
    # Default mode: more microbatches (same result); bitwise: a smaller chunk (other bits).
    hint = r"smaller chunk_size=.*changes the bits" if bitwise else r"raise microbatches="
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"ran out of device memory.*" + hint):
        train(init(), optimizer.init(init()), X, KEY)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"ran out of device memory.*" + hint):
        step(init(), X, KEY)


@pytest.mark.filterwarnings(
    "ignore::unsplit._src.bitwise.schedule.GroupSizeWarning"
)  # 1 row per device
def test_fsdp_group_runs_end_in_the_same_bits_for_every_data_parallel_degree():
    # chunk_axes: params stay sharded over the FSDP group inside the chunk programs.
    auto = (jax.sharding.AxisType.Auto,) * 2
    results = []
    for data in (2, 1):
        devices = np.array(jax.devices()[: data * 4]).reshape(data, 4)
        mesh = jax.sharding.Mesh(devices, ("data", "fsdp"), axis_types=auto)
        params = {
            k: jax.device_put(v, NamedSharding(mesh, P("fsdp"))) for k, v in mlp_init().items()
        }
        optimizer = OPTIMIZERS["clip+adamw"]()
        opt_state = optimizer.init(params)
        step = unsplit.value_and_grad(
            mlp_loss, mesh=mesh, batch_axes=("data", "fsdp"), bitwise=True, chunk_axes="fsdp",
            chunk_size=4,
        )  # fmt: skip
        train = unsplit.train_step(step, optimizer)
        for i in range(3):
            _, params, opt_state = train(params, opt_state, MLP_X, jax.random.fold_in(KEY, i))
        assert params["w1"].sharding.spec == P("fsdp")  # the layout is kept
        for leaf in jax.tree.leaves((params, opt_state)):  # each group's copy is the same
            copies = {}
            for shard in leaf.addressable_shards:
                copies.setdefault(str(shard.index), []).append(np.asarray(shard.data))
            for same in copies.values():
                assert all(unsplit.testing.bits_equal(same[0], other) for other in same[1:])
        results.append(jax.device_get((params, opt_state)))
    assert unsplit.testing.bits_equal(results[0], results[1])
    assert unsplit.testing.rel_l2(results[0][0], mlp_init()) > 1e-4  # it trained


def _equinox():
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        w: jax.Array
        count: jax.Array
        act: object

        def __call__(self, x, key):
            keep = jax.random.bernoulli(key, 0.7, x.shape)
            return jnp.sum(self.act(jnp.where(keep, x, 0.0) @ self.w))

    return eqx, Model


@pytest.mark.parametrize("bitwise", [False, True])
def test_leaves_without_gradients_stay_as_they_are(bitwise):
    # An integer leaf (a counter, NNX's Rngs counts) and a non-array leaf (an activation
    # function): the update leaves both alone, as eqx.apply_updates does.
    eqx, Model = _equinox()
    model = Model(jax.random.normal(jax.random.key(0), (4, 2)), jnp.int32(7), jnp.tanh)
    optimizer = optax.adam(1e-2)
    loss = lambda m, x, key: m(x, key) ** 2  # noqa: E731
    step = unsplit.value_and_grad(loss, bitwise=bitwise)
    train = unsplit.train_step(step, optimizer)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    _, grads = step(model, X, KEY)
    updates, _ = optimizer.update(eqx.filter(grads, eqx.is_inexact_array), state)
    expected = eqx.apply_updates(model, updates)
    for i in range(2):
        _, model, state = train(model, state, X, KEY)
        if i == 0:
            np.testing.assert_allclose(model.w, expected.w, rtol=1e-6)
    assert int(model.count) == 7 and model.act is jnp.tanh


def test_an_equinox_mlp_trains_in_both_modes_with_the_same_bits_across_devices():
    eqx, _ = _equinox()
    mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))  # activation functions among its leaves
    loss = lambda m, x, key: jnp.sum(jax.vmap(m)(x[None]) ** 2)  # noqa: E731
    optimizer = optax.sgd(1e-2)
    results = []
    for mesh in (None, jax.make_mesh((8,), ("data",))):
        for bitwise in (False, True):
            step = unsplit.value_and_grad(
                loss, bitwise=bitwise, mesh=mesh, chunk_size=2 if bitwise else None
            )
            train = unsplit.train_step(step, optimizer)
            model = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, mlp)
            state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))  # (donated)
            for _ in range(2):
                _, model, state = train(model, state, X, KEY)
            assert model.activation is mlp.activation
            results.append(eqx.filter(model, eqx.is_array))
    assert unsplit.testing.rel_l2(results[0], results[1]) < 1e-6
    assert unsplit.testing.bits_equal(results[1], results[3])  # bitwise: 1 device == 8


def test_a_bitwise_train_step_compiles_again_for_a_batch_of_another_dtype():
    step = unsplit.value_and_grad(loss_fn, bitwise=True)
    optimizer = optax.sgd(1e-3)
    train = unsplit.train_step(step, optimizer)
    params = init()
    state = optimizer.init(params)
    _, params, state = train(params, state, X, KEY)
    loss16, _, _ = train(params, state, X.astype(jnp.float16), KEY)
    fresh = unsplit.value_and_grad(loss_fn, bitwise=True)(params, X.astype(jnp.float16), KEY)[0]
    assert unsplit.testing.bits_equal(loss16, fresh)


@pytest.mark.parametrize("bitwise", [False, True])
def test_an_nnx_module_trains_with_its_optimizer_state_on_trainable(bitwise):
    # NNX modules hold integer Rngs counts: unsplit.trainable gives the optax state the
    # grads' structure, and the counts stay as they are.
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 2, rngs=rngs)
            self.dropout = nnx.Dropout(0.3, rngs=rngs)

        def __call__(self, x):
            return self.linear(self.dropout(x))

    def loss(model, x, key):
        nnx.reseed(model, dropout=key)
        return jnp.sum(model(x) ** 2)

    optimizer = optax.adam(1e-2)
    model = Model(nnx.Rngs(0, dropout=1))
    kernel = np.asarray(model.linear.kernel[...])
    state = optimizer.init(unsplit.trainable(model))
    train = unsplit.train_step(unsplit.value_and_grad(loss, bitwise=bitwise), optimizer)
    _, model, state = train(model, state, X, KEY)
    assert not np.array_equal(np.asarray(model.linear.kernel[...]), kernel)
    counts = [x for x in jax.tree.leaves(model) if jnp.issubdtype(x.dtype, jnp.integer)]
    assert counts  # the Rngs counts came back, untouched by the update


# -- step=: the step number folded into the key inside the programs (issue 40, item 6) -----


@pytest.mark.parametrize("bitwise", [False, True])
def test_step_number_gives_the_bits_of_a_host_fold_in(bitwise):
    mesh = jax.make_mesh((4,), ("data",))
    chunk = {"chunk_size": 4} if bitwise else {}
    step = unsplit.value_and_grad(loss_fn, mesh=mesh, bitwise=bitwise, **chunk)
    params = init()
    for i in (0, 3, 2**32 - 1):
        want = step(params, X, jax.random.fold_in(KEY, i))
        assert unsplit.testing.bits_equal(step(params, X, KEY, step=i), want)
    assert unsplit.testing.bits_equal(
        step(params, X, KEY, step=jnp.int32(3)), step(params, X, jax.random.fold_in(KEY, 3))
    )
    optimizer = optax.adam(1e-2)
    train = unsplit.train_step(step, optimizer)
    a, b = ((init(), optimizer.init(init())) for _ in range(2))  # donated: one each
    for i in range(3):
        loss_a, *a = train(*a, X, jax.random.fold_in(KEY, i))
        loss_b, *b = train(*b, X, KEY, step=i)
        assert unsplit.testing.bits_equal((loss_a, a), (loss_b, b))
    by_state = unsplit.train_step(step)
    state = train_state.TrainState.create(apply_fn=None, params=init(), tx=optimizer)
    _, with_number = by_state(state, X, KEY, step=state.step)  # the state's own count
    state = train_state.TrainState.create(apply_fn=None, params=init(), tx=optimizer)
    _, with_fold = by_state(state, X, jax.random.fold_in(KEY, 0))
    assert unsplit.testing.bits_equal(with_number.params, with_fold.params)


def test_a_new_step_number_is_no_new_program():
    traces = []

    def counting_loss(w, x, key):
        traces.append(1)  # runs only while tracing
        return loss_fn(w, x, key)

    step = unsplit.value_and_grad(counting_loss, mesh=jax.make_mesh((4,), ("data",)))
    optimizer = optax.sgd(0.1)
    train = unsplit.train_step(step, optimizer)
    params, opt_state = init(), optimizer.init(init())
    for i in range(2):  # the first call compiles; the second may place params on the mesh
        _, params, opt_state = train(params, opt_state, X, KEY, step=i)
    step(params, X, KEY, step=0)
    traced = len(traces)
    for i in range(2, 5):
        _, params, opt_state = train(params, opt_state, X, KEY, step=i)
        step(params, X, KEY, step=i)
    assert len(traces) == traced


def test_a_negative_step_number_is_refused_by_the_train_function_too():
    train = unsplit.train_step(unsplit.value_and_grad(loss_fn), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"step must be a step number in \[0, 2\*\*32\)"):
        train(init(), optax.sgd(0.1).init(init()), X, KEY, step=-3)


def test_the_recommended_loops_one_key_is_placed_on_the_mesh_once():
    mesh = jax.make_mesh((4,), ("data",))
    optimizer = optax.sgd(0.1)
    train = unsplit.train_step(unsplit.value_and_grad(loss_fn, mesh=mesh), optimizer)
    key = jax.random.key(3)  # on one device, as jax.random.key makes it
    params, opt_state = init(), optimizer.init(init())
    _, params, opt_state = train(params, opt_state, X, key, step=0)
    placed = train.placed_key._placed
    assert placed.sharding == jax.NamedSharding(mesh, jax.P())
    _, params, opt_state = train(params, opt_state, X, key, step=1)
    assert train.placed_key._placed is placed  # not copied to the devices again
    other = jax.random.key(4)
    train(params, opt_state, X, other, step=2)
    assert train.placed_key._given is other
