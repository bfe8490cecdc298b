"""Many processes: 2 local processes x 2 CPU devices (jax.distributed over gloo)."""

import jax
import numpy as np
import pytest

import unsplit
from unsplit._src import test_util as testing
from unsplit._src.processes import launch

pytestmark = pytest.mark.multiprocess
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


def test_launcher_starts_processes_and_collects_results():
    results = launch.run_local_processes(
        "unsplit._src.processes.launch:describe", timeout_s=TIMEOUT
    )
    assert [r["process_index"] for r in results] == [0, 1]
    assert all(r["devices"] == 4 and r["local_devices"] == 2 for r in results)


def test_launcher_reports_a_failing_worker_and_cleans_up():
    with pytest.raises(launch.LaunchError, match=r"process [01] of 2 failed \(exit code 1\)"):
        launch.run_local_processes(
            "unsplit._src.processes.launch:no_such_function", timeout_s=TIMEOUT
        )


def test_default_mode_matches_single_process():
    results = launch.run_local_processes(
        "unsplit._src.processes.distributed_test:worker_step",
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


def test_bitwise_two_processes_are_bit_identical_to_one_device():
    results = launch.run_local_processes(
        "unsplit._src.processes.distributed_test:worker_step",
        kwargs={"microbatches": 2, "bitwise": True},
        timeout_s=TIMEOUT,
    )
    ref = single_process(bitwise=True)
    assert results[0]["hex"] == results[1]["hex"]
    assert testing.bits_equal(from_hex(results[0]["hex"], ref), ref)


def test_bitwise_tensor_parallel_two_processes_match_one_process():
    # 2 processes x 2 devices, (data=2, model=2): the bits of one process at model=2.
    results = launch.run_local_processes(
        "unsplit._src.processes.distributed_test:worker_step",
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


def test_processes_that_disagree_on_the_key_get_a_clear_error():
    with pytest.raises(launch.LaunchError, match=r"processes disagree on the step key"):
        launch.run_local_processes(
            "unsplit._src.processes.distributed_test:worker_step",
            kwargs={"microbatches": 1, "bitwise": False, "skew_key": True},
            timeout_s=TIMEOUT,
        )


def test_processes_that_disagree_inside_their_own_jit_get_an_error_too():
    # The key is traced there: the step compares key, params and settings on device.
    with pytest.raises(launch.LaunchError, match=r"disagree on the step key, the params or"):
        launch.run_local_processes(
            "unsplit._src.processes.distributed_test:worker_step",
            kwargs={"microbatches": 2, "bitwise": False, "skew_key": True, "in_jit": True},
            timeout_s=TIMEOUT,
        )


def test_fifty_adam_steps_are_bit_identical_across_three_schedules():
    steps = 50
    one_device = testing.train(steps, microbatches=8, devices=None, bitwise=True)
    eight_devices = testing.train(steps, microbatches=1, devices=8, bitwise=True)
    results = launch.run_local_processes(
        "unsplit._src.processes.distributed_test:worker_train",
        kwargs={"steps": steps, "microbatches": 2},
        timeout_s=TIMEOUT,
    )
    assert testing.bits_equal(eight_devices, one_device)
    for r in results:
        assert testing.bits_equal(from_hex(r["hex"], one_device), one_device)
    # The runs really trained: the params moved away from their initial values.
    assert testing.rel_l2(one_device, testing.problem()[1]) > 1e-3
