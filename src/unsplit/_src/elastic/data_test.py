"""global_steps: the records of a global step do not depend on the topology."""

import grain
import jax
import numpy as np
import pytest

import unsplit
from unsplit._src.processes import launch

RECORDS, BATCH, SEED = 48, 16, 3  # 3 steps per epoch
STEPS = 7  # into the third epoch


class Records:
    """A random-access source: record ``r`` is ``{"x": [r, r, r], "r": r}``; counts reads."""

    def __init__(self, n=RECORDS):
        self.n, self.reads = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, r):
        self.reads.append(r)
        return {"x": np.full(3, r % 1000, np.float32), "r": np.int64(r)}


def reference_records():
    steps = unsplit.data.global_steps(Records(), global_batch=BATCH, seed=SEED)
    return [steps.records(s).tolist() for s in range(STEPS)]


def assembled(devices):
    """Each step's ids and rows as the global batch unsplit.global_batch assembles."""
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    source = Records()
    steps = unsplit.data.global_steps(source, global_batch=BATCH, seed=SEED, mesh=mesh)
    out = []
    for s in range(STEPS):
        rows, ids = steps[s]
        np.testing.assert_array_equal(rows["r"], ids)  # every row with its own record id
        batch, global_ids = unsplit.global_batch(rows, mesh, ids)
        gather = jax.experimental.multihost_utils.process_allgather
        words = gather(global_ids, tiled=True)  # unsplit.Ids64: two uint32 words
        ids_all = (np.asarray(words.hi, np.int64) << 32) | np.asarray(words.lo, np.int64)
        rows_all = np.asarray(gather(batch["r"], tiled=True))
        np.testing.assert_array_equal(ids_all, rows_all)
        out.append(ids_all.tolist())
    return {"steps": out, "reads": len(source.reads)}


def worker_assembled(devices: int):
    return assembled(devices)


@pytest.mark.parametrize("devices", [1, 4, 8])
def test_same_records_for_any_device_count(devices):
    got = assembled(devices)
    assert got["steps"] == reference_records()
    assert got["reads"] == STEPS * BATCH  # one process reads each of its rows once


@pytest.mark.multiprocess
def test_same_records_on_two_processes_each_reading_only_its_rows():
    results = launch.run_local_processes(
        "unsplit._src.elastic.data_test:worker_assembled",
        num_processes=2,
        devices_per_process=2,
        kwargs={"devices": 4},
        timeout_s=240,
    )
    for r in results:
        assert r["steps"] == reference_records()
        assert r["reads"] == STEPS * BATCH // 2  # half of each step: no copy of the dataset


def test_every_record_once_per_epoch_and_epochs_reshuffled():
    steps = unsplit.data.global_steps(Records(), global_batch=BATCH, seed=SEED)
    epochs = [
        np.concatenate([steps.records(e * 3 + k) for k in range(3)]).tolist() for e in range(2)
    ]
    assert [sorted(e) for e in epochs] == [list(range(RECORDS))] * 2
    assert epochs[0] != epochs[1]
    assert [steps.epoch(s) for s in range(7)] == [0, 0, 0, 1, 1, 1, 2]


def test_remainder_skipped_no_record_twice_in_an_epoch():
    steps = unsplit.data.global_steps(Records(50), global_batch=BATCH, seed=SEED)
    assert steps.steps_per_epoch == 3
    for e in range(3):
        read = np.concatenate([steps.records(e * 3 + k) for k in range(3)])
        assert len(set(read.tolist())) == 48


def test_order_is_grains_shuffle_and_depends_on_seed():
    steps = unsplit.data.global_steps(Records(), global_batch=BATCH, seed=SEED)
    shuffled = grain.MapDataset.range(RECORDS).shuffle(seed=SEED)
    assert steps.records(4).tolist() == [shuffled[RECORDS + BATCH + i] for i in range(BATCH)]
    other = unsplit.data.global_steps(Records(), global_batch=BATCH, seed=SEED + 1)
    assert other.records(0).tolist() != steps.records(0).tolist()


def test_grain_transformations_apply():
    ds = grain.MapDataset.source(Records()).map(lambda e: {**e, "y": e["x"] * 2})
    ds = ds.random_map(lambda e, rng: {**e, "z": rng.integers(0, 10**9)}, seed=1)
    steps = unsplit.data.global_steps(ds, global_batch=BATCH, seed=SEED)
    rows, ids = steps[3]
    np.testing.assert_array_equal(rows["y"], 2 * rows["x"])
    np.testing.assert_array_equal(rows["r"], ids)
    again, _ = unsplit.data.global_steps(ds, global_batch=BATCH, seed=SEED)[3]
    np.testing.assert_array_equal(rows["z"], again["z"])  # deterministic augmentation


def test_a_grain_iterator_reads_ahead_from_any_step():
    steps = unsplit.data.global_steps(Records(), global_batch=BATCH, seed=SEED, num_epochs=2)
    assert len(steps) == 6
    read = [ids.tolist() for _, ids in steps[2:].to_iter_dataset()]
    assert read == [steps.records(s).tolist() for s in range(2, 6)]


def test_64_bit_record_indices():
    steps = unsplit.data.global_steps(Records(2**40), global_batch=8, seed=SEED)
    rows, ids = steps[0]
    assert ids.dtype == np.int64 and ids.max() >= 2**32
    np.testing.assert_array_equal(rows["r"], ids)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    _, global_ids = unsplit.global_batch(rows, mesh, ids)
    assert isinstance(global_ids, unsplit.Ids64)


def test_errors_say_what_and_how_to_fix():
    mesh = jax.make_mesh((8,), ("data",))
    with pytest.raises(ValueError, match=r"global_batch=12 does not split evenly over the 8"):
        unsplit.data.global_steps(Records(), global_batch=12, seed=0, mesh=mesh)
    with pytest.raises(ValueError, match=r"batch_axes='model'.*axes are \('data',\)"):
        unsplit.data.global_steps(Records(), global_batch=8, seed=0, mesh=mesh, batch_axes="model")
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32\).*got -1"):
        unsplit.data.global_steps(Records(), global_batch=8, seed=-1)
    with pytest.raises(ValueError, match=r"48 records, fewer than one global batch"):
        unsplit.data.global_steps(Records(), global_batch=64, seed=0)
    with pytest.raises(TypeError, match=r"random-access source.*got generator"):
        unsplit.data.global_steps((x for x in range(3)), global_batch=1, seed=0)
    steps = unsplit.data.global_steps(Records(), global_batch=8, seed=0, num_epochs=1)
    with pytest.raises(IndexError, match=r"global step 6 is past the end: 1 epoch"):
        steps[6]
    with pytest.raises(TypeError, match=r"a global step is an int >= 0; got -1"):
        steps[-1]
    filtered = grain.MapDataset.source(Records()).filter(lambda e: e["r"] % 2 == 0)
    with pytest.raises(ValueError, match=r"is None \(a grain filter dropped it\)"):
        unsplit.data.global_steps(filtered, global_batch=8, seed=0)[0]
