"""A program compiled for one device, loaded onto others: the same bits, no compile."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import unsplit
from unsplit._src.bitwise import relocate


def grads(w, x, key):
    keep = jax.random.bernoulli(key, 0.8, x.shape)
    return jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.where(keep, x, 0.0) @ w) ** 2))(w)


def example_loss(w, x, key):
    keep = jax.random.bernoulli(key, 0.8, x.shape)
    return jnp.sum(jnp.tanh(jnp.where(keep, x, 0.0) @ w) ** 2)


def test_a_relocated_program_gives_the_bits_of_one_compiled_for_that_device():
    devices = jax.devices()[:4]
    w = jax.random.normal(jax.random.key(0), (64, 32))
    x = jax.random.normal(jax.random.key(1), (16, 64))
    key = jax.random.key(2)  # a typed key: passed to the executable as its data
    first = jax.jit(grads).lower(*jax.device_put((w, x, key), devices[0])).compile()
    for device in devices[1:]:
        args = jax.device_put((w, x, key), device)
        out = relocate.Relocated(first, device)(*args)
        assert out.devices() == {device}
        assert unsplit.testing.bits_equal(out, jax.jit(grads)(*args))
    assert relocate.Relocated(first, devices[1]).as_text() == first.as_text()


def test_a_key_passed_again_is_converted_once_and_a_new_key_is_not_mistaken_for_it():
    d0, d1 = jax.devices()[:2]
    w, x = jax.random.normal(jax.random.key(0), (8, 4)), jnp.ones((2, 8))
    first = jax.jit(grads).lower(*jax.device_put((w, x, jax.random.key(2)), d0)).compile()
    program = relocate.Relocated(first, d1)
    w, x, key, other = jax.device_put((w, x, jax.random.key(2), jax.random.key(3)), d1)
    a = program(w, x, key)
    held = program._keys[2][1]  # the key's data, by the key's argument position
    b = program(w, x, key)
    assert program._keys[2][1] is held  # the same key: its data taken from the last call
    c = program(w, x, other)  # another key at the same position: its own data
    assert unsplit.testing.bits_equal((a, c), (b, jax.jit(grads)(w, x, other)))
    assert not unsplit.testing.bits_equal(a, c)


def test_other_arguments_are_refused():
    d0, d1 = jax.devices()[:2]
    first = jax.jit(lambda a, b: a + b).lower(*jax.device_put((1.0, 2.0), d0)).compile()
    with pytest.raises(TypeError, match=r"expected arguments"):
        relocate.Relocated(first, d1)(jax.device_put(np.float32(1.0), d1))


def test_a_bitwise_step_compiles_its_chunk_program_once_for_every_one_device_group():
    mesh = jax.make_mesh((8,), ("data",))
    step = unsplit.value_and_grad(example_loss, mesh=mesh, bitwise=True, chunk_size=2)
    w = jax.random.normal(jax.random.key(0), (32, 16))
    x = jax.random.normal(jax.random.key(1), (16, 32))
    out = step(w, x, jax.random.key(3))
    (state,) = step._engine._plans.values()
    first, *others = (state.executables[g] for g in range(8))
    assert isinstance(first, jax.stages.Compiled)
    assert all(isinstance(e, relocate.Relocated) and e.compiled is first for e in others)
    one = unsplit.value_and_grad(example_loss, bitwise=True, chunk_size=2)(w, x, jax.random.key(3))
    assert unsplit.testing.bits_equal(out, one)


def test_tensor_parallel_groups_share_one_compile_and_keep_the_bits():
    from jax.sharding import NamedSharding

    from unsplit._src import test_util

    def fresh_loss(p, ex, key):  # its own function: programs are shared per loss function
        return test_util.MLP_LOSSES[True](p, ex, key)

    auto = (jax.sharding.AxisType.Auto,) * 2
    specs = test_util.MLP_LAYOUTS["tp"]
    outs = []
    for data in (4, 1):
        mesh = jax.make_mesh((data, 2), ("data", "model"), axis_types=auto)
        params = {
            k: jax.device_put(v, NamedSharding(mesh, specs[k]))
            for k, v in test_util.mlp_params().items()
        }
        step = unsplit.value_and_grad(fresh_loss, weighted=True, mesh=mesh, bitwise=True)
        outs.append(jax.device_get(step(params, test_util.mlp_batch(), jax.random.key(5))))
        if data == 4:
            (state,) = step._engine._plans.values()
            first, *others = (state.executables[g] for g in range(4))
            assert isinstance(first, jax.stages.Compiled)
            assert all(isinstance(e, relocate.Relocated) and e.compiled is first for e in others)
    assert unsplit.testing.bits_equal(outs[0], outs[1])


def test_one_launch_on_every_device_gives_the_bits_of_the_one_device_program():
    mesh = jax.make_mesh((8,), ("data",))
    replicated = jax.NamedSharding(mesh, jax.P())
    w = jax.device_put(jax.random.normal(jax.random.key(0), (64, 32)), replicated)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 64)), replicated)
    one = jax.sharding.make_single_device_sharding(jax.devices()[0])
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one) for a in (w, x)]

    def f(w, x):
        return jnp.tanh(x @ w) / jnp.linalg.norm(w)

    compiled = jax.jit(f).lower(*avals).compile()
    devices = list(mesh.devices.flat)
    program = relocate.Replicas(compiled, devices)
    copies = [{s.device: s.data for s in a.addressable_shards} for a in (w, x)]
    args = [(copies[0][d], copies[1][d]) for d in devices]
    want = compiled(*jax.device_put((w, x), one))
    for out, device in zip(program(args), devices, strict=True):  # one launch, 8 devices
        assert out.devices() == {device} and unsplit.testing.bits_equal(out, want)
    # Each device its own inputs: another x on device 3 gives what the program gives for it.
    other = jax.device_put(jnp.asarray(jax.device_get(x)) * 2, devices[3])
    args[3] = (copies[0][devices[3]], other)
    want = compiled(*jax.device_put((w, other), one))
    assert unsplit.testing.bits_equal(program(args)[3], want)


@pytest.mark.parametrize("order", ["mesh", "reversed 2-D"])
def test_replicated_leaves_go_in_whole_and_each_device_keeps_its_result(order):
    # The update of replicated params (LoRA adapters): its leaves go to the replicas as they
    # are held (one buffer per device in the mesh's order), for a mesh in any device order.
    devices = jax.devices()[:8]
    if order == "mesh":
        mesh = jax.make_mesh((8,), ("data",))
    else:
        mesh = jax.sharding.Mesh(np.array(devices[::-1]).reshape(2, 4), ("a", "b"))
    replicated = jax.NamedSharding(mesh, jax.P())
    w = jax.device_put(jax.random.normal(jax.random.key(0), (64, 32)), replicated)
    g = jax.device_put(jax.random.normal(jax.random.key(1), (64, 32)), replicated)
    update = jax.jit(lambda w, g: (w - 0.1 * jnp.tanh(g),))
    everywhere = relocate.OnEveryDevice(update, mesh, devices[0])
    assert everywhere.accepts((w, g))
    (out,) = everywhere((w, g), like=(w,))
    assert out.sharding == w.sharding
    want = update(*jax.device_put(jax.device_get((w, g)), devices[0]))[0]
    for shard in out.addressable_shards:
        assert unsplit.testing.bits_equal(shard.data, want)


_OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw_clipped": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3)),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-4),
    "adafactor": lambda: optax.adafactor(1e-3),
}


@pytest.mark.usefixtures("standard_promotion")  # optax mixes Python floats and int32
@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("shape", [(8,), (4, 2)])
def test_the_spmd_update_of_replicated_leaves_gives_the_one_device_programs_bits(name, shape):
    # The update of LoRA adapters as one SPMD program (one asynchronous launch) once it is
    # seen to give the one-device program's bits; then on real values of several steps, every
    # device's copy of every leaf is that program's, and a second call compiles nothing.
    tx = _OPTIMIZERS[name]()
    devices = jax.devices()[:8]
    axes = ("data",) if len(shape) == 1 else ("data", "model")
    mesh = jax.sharding.Mesh(np.array(devices[::-1]).reshape(shape), axes)
    replicated = jax.NamedSharding(mesh, jax.P())
    params = {"a": jax.random.normal(jax.random.key(0), (64, 8)), "b": jnp.zeros((8, 33))}

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    everywhere = relocate.OnEveryDevice(jax.jit(update), mesh, devices[0])
    one_device = jax.jit(update)
    trees = jax.device_put((params, tx.init(params)), replicated)
    for step in range(3):
        grads = {
            k: jax.random.normal(jax.random.key(10 * step + i), p.shape)
            for i, (k, p) in enumerate(params.items())
        }
        args = (*trees, jax.device_put(grads, replicated))
        assert everywhere.accepts(args)
        trees = everywhere(args, like=args[:2])
        want = one_device(*jax.device_put(jax.device_get(args), devices[0]))
        for got, expected in zip(jax.tree.leaves(trees), jax.tree.leaves(want), strict=True):
            assert got.sharding.is_fully_replicated and got.sharding.mesh == mesh
            for shard in got.addressable_shards:
                assert unsplit.testing.bits_equal(shard.data, expected)
    assert list(everywhere.verified.values()) == [True]  # the SPMD program, one signature
    program, _ = next(iter(everywhere._programs.values()))
    assert not isinstance(program, relocate.Replicas) and program._cache_size() == 1


def test_a_program_that_gives_other_bits_is_found_and_the_replicas_run_instead(monkeypatch):
    # The check itself: a program whose bits differ from the one-device program's in a last
    # place only is told apart on random inputs; and when the check fails, the one-device program's machine
    # code runs on every device (Replicas), with its bits.
    one = jax.sharding.make_single_device_sharding(jax.devices()[0])
    mesh = jax.make_mesh((8,), ("data",))
    whole = jax.NamedSharding(mesh, jax.P())
    avals = [jax.ShapeDtypeStruct((4096,), jnp.float32, sharding=one)] * 3

    def written(a, b, c):
        return (a * b + c,)

    def other(a, b, c):  # the same up to a rounding in the last place of some elements
        return (a * (b * (1 + 2**-23)) + c,)

    compiled = jax.jit(written).lower(*avals).compile()
    leaves = [jax.device_put(jnp.ones(4096), whole)] * 3
    treedef = jax.tree.structure((0, 0, 0))
    same = relocate._same_bits(compiled, jax.jit(written), leaves, treedef, one, whole)
    differs = relocate._same_bits(compiled, jax.jit(other), leaves, treedef, one, whole)
    assert same and not differs
    monkeypatch.setattr(relocate, "_same_bits", lambda *args: False)
    everywhere = relocate.OnEveryDevice(jax.jit(written), mesh, jax.devices()[0])
    x = [jax.device_put(jax.random.normal(jax.random.key(i), (4096,)), whole) for i in range(3)]
    (out,) = everywhere(tuple(x))
    assert list(everywhere.verified.values()) == [False]
    assert isinstance(next(iter(everywhere._programs.values()))[0], relocate.Replicas)
    want = compiled(*jax.device_put(jax.device_get(x), jax.devices()[0]))[0]
    assert all(unsplit.testing.bits_equal(s.data, want) for s in out.addressable_shards)
