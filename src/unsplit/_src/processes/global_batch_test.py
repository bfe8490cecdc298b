"""global_batch in one process: rows become a sharded global batch with position ids."""

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils

import unsplit
from unsplit._src import test_util as testing
from unsplit._src.models import transformer as tf
from unsplit._src.processes import launch


def test_rows_become_a_sharded_global_batch_with_position_ids():
    mesh = jax.make_mesh((4,), ("data",))
    rows = {"x": np.arange(24, dtype=np.float32).reshape(8, 3), "y": np.arange(8)}
    batch, ids = unsplit.global_batch(rows, mesh)
    assert batch["x"].sharding.spec == jax.P("data")
    np.testing.assert_array_equal(np.asarray(batch["x"]), rows["x"])
    np.testing.assert_array_equal(np.asarray(ids), np.arange(8))


def test_record_ids_travel_with_their_rows_and_give_the_same_step():
    model, params, data = testing.problem()
    mesh = jax.make_mesh((2,), ("data",))
    records = np.arange(64, dtype=np.uint32) * 7 + 3
    batch, ids = unsplit.global_batch(data, mesh, local_ids=records)
    step = unsplit.value_and_grad(tf.token_loss(model), weighted=True, mesh=mesh)
    key = jax.random.key(1)
    _, grads = step(params, batch, key, ids=ids)
    _, direct = unsplit.value_and_grad(tf.token_loss(model), weighted=True)(
        params, data, key, ids=records
    )
    assert testing.rel_l2(grads, direct) <= 1e-5


def test_bad_local_ids():
    mesh = jax.make_mesh((2,), ("data",))
    rows = {"x": np.ones((4, 2), np.float32)}
    with pytest.raises(ValueError, match=r"local_ids must have shape \(4,\).*got shape \(3,\)"):
        unsplit.global_batch(rows, mesh, local_ids=np.arange(3))
    with pytest.raises(ValueError, match=r"non-negative"):
        unsplit.global_batch(rows, mesh, local_ids=np.array([0, 1, -2, 3]))
    with pytest.raises(ValueError, match=r"no array leaves"):
        unsplit.global_batch({}, mesh)


@pytest.mark.parametrize("bitwise", [False, True])
def test_64_bit_record_ids(bitwise):
    _, params, data = testing.problem()
    mesh = jax.make_mesh((2,), ("data",))
    records = np.arange(64, dtype=np.int64) + 2**40
    batch, ids = unsplit.global_batch(data, mesh, local_ids=records)
    assert isinstance(ids, unsplit.Ids64)
    key = jax.random.key(1)
    _, grads = unsplit.value_and_grad(
        testing.weighted_loss(), weighted=True, mesh=mesh, bitwise=bitwise
    )(params, batch, key, ids=ids)
    _, direct = unsplit.value_and_grad(testing.weighted_loss(), weighted=True, bitwise=bitwise)(
        params, data, key, ids=records
    )
    assert testing.rel_l2(grads, direct) <= 1e-5


# ---- global_batch: a process's bad rows -----------------------------------------------


@pytest.mark.parametrize(
    ("rows", "error", "message"),
    [
        ({"x": [[1.0, 2.0], [3.0, 4.0]]}, TypeError, r"leaf \['x'\]\[0\]\[0\] is a scalar .*"
         r"nested Python list .*Fix: convert it to an array, e.g. np.asarray\(rows\)"),
        ({"x": np.ones((4, 2)), "y": np.ones(3)}, ValueError, r"leaves have different row "
         r"counts \(\['x'\]: 4, \['y'\]: 3\).*Fix: give every leaf the same number of rows"),
        ({"x": np.ones((6, 2))}, ValueError, r"this process has rows=6, not divisible by its 4 "
         r"devices along the batch axes \('data',\).*Fix: pass a multiple of 4 rows .*\(e.g. 4\)"),
        ({}, ValueError, r"local_batch has no array leaves"),
    ],
)  # fmt: skip
def test_global_batch_refuses_bad_rows_with_the_fix(rows, error, message):
    mesh = jax.make_mesh((4,), ("data",))
    with pytest.raises(error, match=message):
        unsplit.global_batch(rows, mesh)


def test_global_batch_refuses_bad_arguments():
    mesh = jax.make_mesh((4,), ("data",))
    rows = {"x": np.ones((4, 2), np.float32)}
    with pytest.raises(ValueError, match=r"batch_axes must name axes of the mesh \('data',\)"):
        unsplit.global_batch(rows, mesh, batch_axes="model")
    with pytest.raises(ValueError, match=r"check must be one of .*got check='sometimes'"):
        unsplit.global_batch(rows, mesh, check="sometimes")
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh; got dict"):
        unsplit.global_batch(rows, {"data": 4})


def test_global_batch_splits_over_the_named_batch_axes():
    mesh = jax.make_mesh((2, 4), ("model", "data"))
    rows = {"x": np.arange(8, dtype=np.float32)}
    batch, ids = unsplit.global_batch(rows, mesh, batch_axes="data")
    assert batch["x"].sharding.spec == jax.P("data")
    np.testing.assert_array_equal(np.asarray(ids), np.arange(8))


# ---- 2 processes x 2 CPU devices (jax.distributed over gloo): the one-device step --------

TIMEOUT = 240  # seconds per launch; every process is killed when it expires
KEY_SEED = 5


# ---- worker functions: run inside each of the launched processes -------------------


def worker_step(
    microbatches: int, bitwise: bool, skew_key: bool = False, in_jit: bool = False, model: int = 1
):
    """One step over the 4 global devices; returns loss and grads as exact hex.

    ``model=2``: a (data=2, model=2) mesh, params sharded over ``model`` (tensor
    parallel inside each process).
    """
    _, params, batch = testing.problem()
    mesh = _mesh(jax.device_count(), model)
    rows = 64 // jax.process_count()
    mine = jax.tree.map(lambda x: x[jax.process_index() * rows :][:rows], batch)
    global_rows, ids = unsplit.global_batch(mine, mesh)
    step = unsplit.value_and_grad(
        testing.weighted_loss(), weighted=True, microbatches=microbatches, mesh=mesh,
        bitwise=bitwise,
    )  # fmt: skip
    key = jax.random.key(KEY_SEED + (jax.process_index() if skew_key else 0))
    run = jax.jit(step) if in_jit else step
    specs = testing.tensor_parallel_specs(params) if model > 1 else None
    loss, grads = run(testing.replicated(params, mesh, specs), global_rows, key, ids=ids)
    host = jax.tree.map(testing.local_value, (loss, grads))
    return {"hex": testing.to_hex(host), "ids": np.asarray(ids.addressable_data(0)).tolist()}


def _mesh(devices: int, model: int):
    if model == 1:
        return jax.make_mesh((devices,), ("data",))
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((devices // model, model), ("data", "model"), axis_types=auto)


def worker_pieces():
    """Every leaf counted large (a sums vector of its own): replicated params take the
    PIECE layout (divided pieces all-gathered across the processes), FSDP params the SHARD
    layout (pieces permuted into their shards). Returns each step's bits and layouts."""
    from unsplit._src.bitwise import plan as plan_lib
    from unsplit._src.bitwise.combine import scatter

    plan_lib._DIRECT_ELEMENTS = 1
    _, params, batch = testing.problem()
    mesh = _mesh(jax.device_count(), 1)
    rows = 64 // jax.process_count()
    mine = jax.tree.map(lambda x: x[jax.process_index() * rows :][:rows], batch)
    global_rows, ids = unsplit.global_batch(mine, mesh)
    out = {}
    for name, specs in [("piece", None), ("shard", testing.fsdp_specs(params, "data", 4))]:
        step = unsplit.value_and_grad(
            testing.weighted_loss(), weighted=True, mesh=mesh, bitwise=True
        )
        loss, grads = step(
            testing.replicated(params, mesh, specs), global_rows, jax.random.key(KEY_SEED), ids=ids
        )
        (runner,) = step._engine._plans.values()
        whole = [multihost_utils.process_allgather(x, tiled=True) for x in jax.tree.leaves(grads)]
        out[name] = {
            "hex": testing.to_hex([testing.local_value(loss), *whole]),
            "layouts": sorted(set(scatter.layouts(runner.plan))),
            "fused": runner.fused is not None,
        }
    return out


def worker_train(steps: int, microbatches: int):
    params = testing.train(steps, microbatches, devices=jax.device_count(), bitwise=True)
    return {"hex": testing.to_hex(params)}


# ---- tests ---------------------------------------------------------------------------


def single_process(microbatches=1, bitwise=False):
    _, params, batch = testing.problem()
    step = unsplit.value_and_grad(
        testing.weighted_loss(), weighted=True, microbatches=microbatches, bitwise=bitwise
    )
    return step(params, batch, jax.random.key(KEY_SEED))


def from_hex(hexes, like):
    leaves, treedef = jax.tree.flatten(like)
    arrays = [
        np.frombuffer(bytes.fromhex(h), np.asarray(x).dtype).reshape(np.shape(x))
        for h, x in zip(hexes, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, arrays)


@pytest.mark.multiprocess
def test_default_mode_matches_single_process():
    results = launch.run_local_processes(
        "unsplit._src.processes.global_batch_test:worker_step",
        kwargs={"microbatches": 2, "bitwise": False},
        timeout_s=TIMEOUT,
    )
    ref = single_process()
    for r in results:
        loss, grads = from_hex(r["hex"], ref)
        assert abs(float(loss) - float(ref[0])) <= 1e-5 * float(ref[0])
        assert testing.rel_l2(grads, ref[1]) <= 1e-5
    # global_batch gave each process the ids of its rows' global positions.
    assert results[0]["ids"] + results[1]["ids"] != []
    assert sorted(results[0]["ids"]) == results[0]["ids"]


@pytest.mark.multiprocess
def test_bitwise_two_processes_are_bit_identical_to_one_device():
    results = launch.run_local_processes(
        "unsplit._src.processes.global_batch_test:worker_step",
        kwargs={"microbatches": 2, "bitwise": True},
        timeout_s=TIMEOUT,
    )
    ref = single_process(bitwise=True)
    assert results[0]["hex"] == results[1]["hex"]
    assert testing.bits_equal(from_hex(results[0]["hex"], ref), ref)


@pytest.mark.multiprocess
def test_bitwise_tensor_parallel_two_processes_match_one_process():
    # 2 processes x 2 devices, (data=2, model=2): the bits of one process at model=2.
    results = launch.run_local_processes(
        "unsplit._src.processes.global_batch_test:worker_step",
        kwargs={"microbatches": 1, "bitwise": True, "model": 2},
        timeout_s=TIMEOUT,
    )
    _, params, batch = testing.problem()
    mesh = _mesh(2, 2)
    step = unsplit.value_and_grad(testing.weighted_loss(), weighted=True, mesh=mesh, bitwise=True)
    placed = testing.replicated(params, mesh, testing.tensor_parallel_specs(params))
    ref = jax.tree.map(testing.local_value, step(placed, batch, jax.random.key(KEY_SEED)))
    assert results[0]["hex"] == results[1]["hex"]
    assert testing.bits_equal(from_hex(results[0]["hex"], ref), ref)


@pytest.mark.multiprocess
def test_grad_pieces_divided_and_gathered_across_processes_keep_the_one_device_bits():
    # 2 processes x 2 devices, every leaf a sums vector of its own: the pieces' all-gather
    # (replicated) and their permute into the FSDP shards cross the processes.
    results = launch.run_local_processes(
        "unsplit._src.processes.global_batch_test:worker_pieces", timeout_s=TIMEOUT
    )
    ref = single_process(bitwise=True)
    for r in results:
        assert "piece" in r["piece"]["layouts"] and r["piece"]["fused"]
        assert "shard" in r["shard"]["layouts"] and r["shard"]["fused"]
        for name in ("piece", "shard"):
            assert testing.bits_equal(from_hex(r[name]["hex"], ref), ref), name


@pytest.mark.multiprocess
def test_fifty_adam_steps_are_bit_identical_across_three_schedules():
    steps = 50
    one_device = testing.train(steps, microbatches=8, devices=None, bitwise=True)
    eight_devices = testing.train(steps, microbatches=1, devices=8, bitwise=True)
    results = launch.run_local_processes(
        "unsplit._src.processes.global_batch_test:worker_train",
        kwargs={"steps": steps, "microbatches": 2},
        timeout_s=TIMEOUT,
    )
    assert testing.bits_equal(eight_devices, one_device)
    for r in results:
        assert testing.bits_equal(from_hex(r["hex"], one_device), one_device)
    # The runs really trained: the params moved away from their initial values.
    assert testing.rel_l2(one_device, testing.problem()[1]) > 1e-3
