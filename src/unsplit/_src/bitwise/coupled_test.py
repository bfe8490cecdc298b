"""Bitwise mode with ``batch_loss``: bit-identical across schedules, close to the formula.

The CLIP-style model of ``unsplit/_src/step/coupled_test.py`` (two towers with
dropout, in-batch negatives, a learnable temperature used only by the batch loss).
"""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import test_util as testing

pytestmark = pytest.mark.xdist_group("bitwise")
CHUNK = 4  # 32 examples over 8 devices: 4 each
KEY = testing.CLIP_KEY


def mesh_of(devices):
    return None if devices == 1 else jax.make_mesh((devices,), ("data",))


@functools.cache
def formula():
    return testing.clip_reference(testing.clip_params(), testing.clip_batch(), KEY)


def run(devices, microbatches, *, params=None, has_aux=False, mesh=None):
    step = unsplit.value_and_grad(
        testing.clip_features,
        batch_loss=testing.clip_batch_loss_with_aux if has_aux else testing.clip_batch_loss,
        has_aux=has_aux,
        microbatches=microbatches,
        mesh=mesh if mesh is not None else mesh_of(devices),
        bitwise=True,
        chunk_size=CHUNK,
    )
    return step(params if params is not None else testing.clip_params(), testing.clip_batch(), KEY)


@functools.cache
def reference():
    return run(1, 1)


@pytest.mark.parametrize("microbatches", [1, 2, 4])
@pytest.mark.parametrize("devices", [1, 2, 8])
def test_grid_is_bit_identical_and_close_to_the_formula(devices, microbatches):
    out = run(devices, microbatches)
    assert testing.bits_equal(out, reference())
    testing.clip_close(out, formula())


def test_fsdp_params_give_the_same_bits():
    mesh = jax.make_mesh((8,), ("data",))

    def place(path, x):
        spec = P("data") if path[-1].key == "w1" else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    params = jax.tree_util.tree_map_with_path(place, testing.clip_params())
    loss, grads = run(8, 1, params=params, mesh=mesh)
    assert testing.bits_equal((loss, grads), reference())
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
        assert g.sharding == p.sharding


def test_has_aux_is_bit_identical():
    (l1, a1), g1 = run(1, 1, has_aux=True)
    (l8, a8), g8 = run(8, 2, has_aux=True)
    assert testing.bits_equal((l1, a1, g1), (l8, a8, g8))
    assert testing.bits_equal((l1, g1), reference())


def test_bitwise_train_step_gives_the_same_params_for_every_schedule():
    optimizer = optax.sgd(0.1, momentum=0.9)
    ends = []
    for devices, microbatches in [(1, 1), (8, 1), (2, 4)]:
        step = unsplit.value_and_grad(
            testing.clip_features,
            batch_loss=testing.clip_batch_loss,
            microbatches=microbatches,
            mesh=mesh_of(devices),
            bitwise=True,
            chunk_size=CHUNK,
        )
        train = unsplit.bitwise_train_step(step, optimizer)
        params = testing.clip_params()
        state = optimizer.init(params)
        for i in range(2):
            key = jax.random.fold_in(KEY, i)
            _, params, state = train(params, state, testing.clip_batch(), key)
        ends.append(jax.tree.map(np.asarray, params))
    assert testing.bits_equal(ends[0], ends[1])
    assert testing.bits_equal(ends[0], ends[2])


def tensor_parallel(data: int, *, batch_axes=None, chunk_axes=None, microbatches=1, axes=None):
    """The CLIP step with each tower's hidden layer sharded over ``model`` (Megatron's
    column-then-row split), on a (data, model=2) mesh."""
    axes = axes or ("data", "model")
    mesh = jax.make_mesh((data, 2), axes, axis_types=(AxisType.Auto,) * 2)

    def place(path, x):
        name = path[-1].key
        spec = P(None, axes[1]) if name == "w1" else P(axes[1], None) if name == "w2" else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    params = jax.tree_util.tree_map_with_path(place, testing.clip_params())
    step = unsplit.value_and_grad(
        testing.clip_features,
        batch_loss=testing.clip_batch_loss_with_aux,
        has_aux=True,
        microbatches=microbatches,
        mesh=mesh,
        batch_axes=batch_axes,
        bitwise=True,
        chunk_size=CHUNK,
        chunk_axes=chunk_axes,
    )
    (loss, aux), grads = step(params, testing.clip_batch(), KEY)
    for g, x in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
        assert g.sharding == x.sharding
    return loss, aux, grads


@pytest.mark.slow  # the Python 3.12 fast subset leaves it out; ./dev test runs it
def test_tensor_parallel_is_bit_identical_for_every_data_parallel_degree():
    # Issue 21: bitwise batch_loss with params sharded over a model axis: each chunk runs on
    # its (model=2) group; the batch loss runs on one group per process.
    ends = [tensor_parallel(1)]
    ends += [tensor_parallel(2, microbatches=2), tensor_parallel(4)]
    for out in ends[1:]:
        assert testing.bits_equal(out, ends[0])
    loss, _, grads = ends[0]
    testing.clip_close((loss, grads), formula())


def test_fsdp_groups_are_bit_identical_whatever_the_outer_degree():
    # chunk_axes: the chunk's rows split over the group's devices, params sharded over it.
    one = tensor_parallel(1, axes=("data", "fsdp"), batch_axes=("data", "fsdp"),
                          chunk_axes="fsdp")  # fmt: skip
    four = tensor_parallel(4, axes=("data", "fsdp"), batch_axes=("data", "fsdp"),
                           chunk_axes="fsdp", microbatches=2)  # fmt: skip
    assert testing.bits_equal(one, four)
    loss, _, grads = one
    testing.clip_close((loss, grads), formula())


def worker_coupled(microbatches: int, model: int = 1):
    """One of 2 processes x 2 devices: the bitwise coupled step over the 4 global devices
    (``model=2``: each process's two devices one tensor-parallel group)."""
    data = jax.device_count() // model
    mesh = jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    batch = testing.clip_batch()
    rows = testing.CLIP_B // jax.process_count()
    mine = jax.tree.map(lambda x: np.asarray(x)[jax.process_index() * rows :][:rows], batch)
    global_rows, ids = unsplit.global_batch(mine, mesh, batch_axes="data")
    step = unsplit.value_and_grad(
        testing.clip_features, batch_loss=testing.clip_batch_loss_with_aux, has_aux=True,
        microbatches=microbatches, mesh=mesh, batch_axes="data", bitwise=True, chunk_size=CHUNK,
    )  # fmt: skip

    def place(path, x):
        name = path[-1].key
        spec = P()
        if model > 1:
            spec = P(None, "model") if name == "w1" else P("model", None) if name == "w2" else P()
        host = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), host.__getitem__)

    params = jax.tree_util.tree_map_with_path(place, testing.clip_params())
    out = step(params, global_rows, KEY, ids=ids)
    return {"hex": testing.to_hex(jax.tree.map(testing.local_value, out))}


@pytest.mark.multiprocess
def test_two_processes_give_the_one_device_bits():
    from unsplit._src.processes import launch

    results = launch.run_local_processes(
        "unsplit._src.bitwise.coupled_test:worker_coupled",
        kwargs={"microbatches": 2},
        timeout_s=240,
    )
    ref = jax.device_get(run(1, 1, has_aux=True))
    assert results[0]["hex"] == results[1]["hex"] == testing.to_hex(ref)


@pytest.mark.multiprocess
def test_two_processes_tensor_parallel_give_the_one_process_bits():
    from unsplit._src.processes import launch

    results = launch.run_local_processes(
        "unsplit._src.bitwise.coupled_test:worker_coupled",
        kwargs={"microbatches": 1, "model": 2},
        timeout_s=240,
    )
    loss, aux, grads = tensor_parallel(1)
    ref = jax.tree.map(np.asarray, ((loss, aux), grads))
    assert results[0]["hex"] == results[1]["hex"] == testing.to_hex(ref)
