"""Bitwise steps on any mesh axis order, and groups spread over processes.

* Any axis order (issue 27, item 3): the group axes first, last or in between give
  the bits of the same groups on the canonical ``(data, group)`` order, for FSDP
  groups (``chunk_axes``) and tensor-parallel groups.
* Groups over processes (item 1): FSDP groups (with a sequence axis too) and
  tensor-parallel groups whose devices belong to two processes give the bits of the
  same groups inside one process under ``jax.distributed`` and of a plain process (and
  tensor-parallel groups those of another degree: issue 37)
  (item 2: FSDP groups' in-group sums are unsplit's, the train step's optimizer update's
  too, with a global-norm clip; one launch runs every layout).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import frozen as frozen_lib
from unsplit._src import test_util as testing
from unsplit._src.bitwise import placement
from unsplit._src.models import transformer as tf

pytestmark = pytest.mark.xdist_group("bitwise")
KEY = jax.random.fold_in(jax.random.key(0), 23)
MODEL, PARAMS, BATCH = testing.problem()
WEIGHTED = tf.token_loss(MODEL)
# Device orders of two processes x 4 devices: every group of 2 or 4 consecutive mesh
# positions then holds devices of both processes.
SPREAD = (0, 4, 1, 5, 2, 6, 3, 7)

# name: (mesh shape, axis names, params layout, the axis params are sharded over)
LAYOUTS = {
    "fsdp": ((2, 4), ("data", "fsdp"), "fsdp"),
    "fsdp_first": ((4, 2), ("fsdp", "data"), "fsdp"),
    "tp": ((4, 2), ("data", "model"), "tp"),
    "tp1": ((8, 1), ("data", "model"), "tp"),  # model degree 1: computed at degree 2
    "tp_first": ((2, 4), ("model", "data"), "tp"),
    "fsdp2_tp": ((2, 2, 2), ("data", "fsdp", "model"), "fsdp+tp"),
    "fsdp2_tp_middle": ((2, 2, 2), ("model", "fsdp", "data"), "fsdp+tp"),
    "fsdp2_spare": ((2, 2, 2), ("data", "spare", "fsdp"), "fsdp"),
    "fsdp2_spare_middle": ((2, 2, 2), ("data", "fsdp", "spare"), "fsdp"),
    "fsdp8": ((1, 8), ("data", "fsdp"), "fsdp"),
    # FSDP groups with a sequence axis: each example's tokens over "seq" (the loss's annotation)
    "fsdp2_seq": ((2, 2, 2), ("data", "fsdp", "seq"), "fsdp+seq"),
}


def _specs(mesh, layout):
    if layout == "tp":
        return testing.megatron_specs(PARAMS, "model")
    fsdp = testing.fsdp_specs(PARAMS, "fsdp", mesh.shape["fsdp"])
    if layout in ("fsdp", "fsdp+seq"):
        return fsdp
    tp = testing.megatron_specs(PARAMS, "model")  # both: FSDP where TP leaves a dim free
    return jax.tree.map(
        lambda f, t: t if any(t) else f, fsdp, tp, is_leaf=lambda x: isinstance(x, P)
    )


def run_layout(name: str, order=None, train: bool = False) -> list[str]:
    """The bitwise step's (loss, grads) on layout ``name`` as hex, in any process count
    (``train``: the params and optimizer state after 2 ``train_step`` calls instead)."""
    shape, names, layout = LAYOUTS[name]
    devices = jax.devices()
    if order is not None:
        devices = [devices[i] for i in order]
    mesh = Mesh(np.array(devices).reshape(shape), names, axis_types=(AxisType.Auto,) * len(shape))
    group = "fsdp" in layout
    batch_axes = ("data", "fsdp") if group else "data"
    params = testing.replicated(jax.tree.map(np.asarray, PARAMS), mesh, _specs(mesh, layout))
    step = unsplit.value_and_grad(
        _seq_loss(mesh) if "seq" in layout else WEIGHTED, weighted=True, mesh=mesh, batch_axes=batch_axes, bitwise=True,
        chunk_axes="fsdp" if group else None,
    )  # fmt: skip
    rows, ids = BATCH, None
    if jax.process_count() > 1:  # each process's rows: those its devices hold
        size = len(BATCH["inputs"])
        index = NamedSharding(mesh, P(batch_axes)).addressable_devices_indices_map((size,))
        starts = sorted({i[0].start or 0 for i in index.values()})
        block = size // math.prod(mesh.shape[a] for a in np.atleast_1d(batch_axes))
        mine = np.concatenate([np.arange(s, s + block) for s in starts])
        rows, ids = unsplit.global_batch(
            jax.tree.map(lambda x: np.asarray(x)[mine], BATCH), mesh, batch_axes=batch_axes
        )
    if train:
        import optax

        # A clip that clips (the grads' norm is above 0.1): a global norm summed across the
        # FSDP group (unsplit's fixed order), then AdamW; 2 steps.
        optimizer = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2))
        run = unsplit.train_step(step, optimizer)
        out = [params, optimizer.init(params)]
        with jax.numpy_dtype_promotion("standard"):  # optax mixes floats and int32
            for i in range(2):
                _, *out = run(*out, rows, jax.random.fold_in(KEY, i), ids=ids)
    else:
        out = step(params, rows, KEY, ids=ids)
    return testing.to_hex([_whole(x) for x in jax.tree.leaves(out)])


def _seq_loss(mesh):
    """The test loss with each example's tokens sharded over ``seq`` (context parallelism)."""
    tokens = NamedSharding(mesh, P("seq"))

    def loss(params, example, key):
        example = {**example, "inputs": jax.lax.with_sharding_constraint(example["inputs"], tokens)}
        return WEIGHTED(params, example, key)

    return loss


def _whole(x):
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@functools.cache
def one_process(name: str) -> list[str]:
    return run_layout(name)


@pytest.mark.parametrize(
    "name,canonical",
    [
        ("fsdp_first", "fsdp"),
        ("fsdp2_tp_middle", "fsdp2_tp"),  # FSDP + tensor parallel, the chunk axis in the middle
        pytest.param("tp_first", "tp", marks=pytest.mark.slow),
        pytest.param("fsdp2_spare_middle", "fsdp2_spare", marks=pytest.mark.slow),
    ],
)
def test_group_axes_may_come_first_last_or_in_between(name, canonical):
    assert one_process(name) == one_process(canonical)


def test_rename_keeps_the_buffers_and_copies_only_when_it_must():
    devices = jax.devices()[:4]
    a = Mesh(np.array(devices).reshape(2, 2), ("x", "y"))
    b = Mesh(np.array(devices).reshape(2, 2).T, ("y", "x"))  # the same devices, transposed
    x = jax.device_put(np.arange(8.0), NamedSharding(a, P("y")))
    renamed = placement.rename(x, NamedSharding(b, P("y")))
    assert renamed.sharding.mesh.axis_names == ("y", "x")
    before = {s.device: s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    assert {s.device: s.data.unsafe_buffer_pointer() for s in renamed.addressable_shards} == before
    # Another block per device (sharded over "x" instead): copied, the values kept.
    moved = placement.rename(x, NamedSharding(b, P("x")))
    assert moved.sharding.spec == P("x") and moved.tolist() == list(range(8))


def worker_spread(cases: dict) -> dict:
    """One of 2 processes x 4 devices: each case's bits (``[layout, spread, train]``), and
    the verdict of the combine's check of pairwise collectives over both processes."""
    from unsplit._src.bitwise.combine import pairwise

    out = {
        name: run_layout(layout, SPREAD if spread else None, train)
        for name, (layout, spread, train) in cases.items()
    }
    both = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    out["pairs exact"] = bool(pairwise.exact(both, 1, np.float32))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_groups_spread_over_processes_give_the_bits_of_groups_inside_one():
    from unsplit._src.processes import launch

    cases = {
        "fsdp_spread": ("fsdp", True, False),  # each group's devices in both processes
        "tp_spread": ("tp", True, False),  # tensor-parallel groups of 2 over both
        # train_step's grouped update: clip_by_global_norm + AdamW, its global norm summed
        # across each FSDP group in unsplit's order (compared with the plain process below)
        "train_fsdp_spread": ("fsdp", True, True),
        "fsdp_seq_spread": ("fsdp2_seq", True, False),  # FSDP x seq groups of 4 over both
    }
    results = launch.run_local_processes(
        "unsplit._src.bitwise.placement_test:worker_spread",
        num_processes=2,
        devices_per_process=4,
        kwargs={"cases": cases},
        timeout_s=900,
    )
    assert results[0] == results[1]
    (got,) = results[:1]
    # Reduce-scatters of two devices across the two processes (gloo): seen to add exactly,
    # by both processes alike (the combine's pairwise path runs there).
    assert got["pairs exact"] is True
    # The bits of this plain 8-device process too (no jax.distributed, no gloo): FSDP groups
    # (their in-group sums are unsplit's, in a fixed order), with a sequence axis in the group,
    # and tensor-parallel groups.
    assert got["fsdp_spread"] == one_process("fsdp")
    assert got["train_fsdp_spread"] == run_layout("fsdp", train=True)
    assert got["fsdp_seq_spread"] == one_process("fsdp2_seq")
    assert got["tp_spread"] == one_process("tp")
    # Another tensor-parallel degree in a plain process: degree 1 (the canonical blocks).
    assert got["tp_spread"] == one_process("tp1")


def test_blocks_gathered_in_one_collective_are_the_per_dimension_all_gathers():
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "m"))
    x = np.arange(8 * 8 * 4, dtype=np.float32).reshape(8, 8, 4)
    specs = (P(("a", "b")), P("b", "a"), P(None, ("b", "a")), P("m"), P(), P("a", "m"))
    gathers = [
        (("a", "b"), (), ()), (("b",), ("a",), ()), ((), ("b", "a"), ()), ((), (), ()),
        ((), (), ()), (("a",), (), ()),
    ]  # fmt: skip

    def one(*blocks):  # every device's result, stacked: the blocks differ per device
        out = placement.gathered_blocks(list(blocks), gathers, dict(mesh.shape))
        return tuple(b[None] for b in out)

    def each(*blocks):
        out = []
        for b, g in zip(blocks, gathers, strict=True):
            for dim, axes in enumerate(g):
                if axes:
                    b = jax.lax.all_gather(
                        b, axes if len(axes) > 1 else axes[0], axis=dim, tiled=True
                    )
            out.append(b[None])
        return tuple(out)

    args = [jax.device_put(x, NamedSharding(mesh, s)) for s in specs]
    every = (P(("a", "b", "m")),) * len(specs)

    def run(fn):
        return jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=every, check_vma=False)
        )

    for a, b in zip(run(one)(*args), run(each)(*args), strict=True):
        np.testing.assert_array_equal(a, b)
    hlo = run(one).lower(*args).compile().as_text()
    assert hlo.count("all-gather(") + hlo.count("all-gather-start(") == 1


# Frozen inputs (issue 40, items 1 and 3): never packed into the flat params, the caller's
# buffers where every device holds them, gathered once where they are sharded.
LORA_D, LORA_R = 64, 4


def lora_loss(lora, x, key, base):
    h = x @ base["w"] + (x @ lora["a"]) @ lora["b"]
    return jnp.mean(unsplit.dropout(key, jnp.tanh(h), 0.1) ** 2)


def lora_problem(mesh, base_spec):
    rng = np.random.default_rng(0)
    base = {"w": rng.normal(size=(LORA_D, LORA_D)).astype(np.float32) / 8}
    lora = {
        "a": rng.normal(size=(LORA_D, LORA_R)).astype(np.float32) / 8,
        "b": rng.normal(size=(LORA_R, LORA_D)).astype(np.float32) / 8,
    }
    base = jax.device_put(base, NamedSharding(mesh, base_spec))
    lora = jax.device_put(lora, NamedSharding(mesh, P()))
    x = jax.device_put(
        rng.normal(size=(16, LORA_D)).astype(np.float32), NamedSharding(mesh, P("data"))
    )
    return lora, base, x


def _runner(step, lora, base, x):
    step(lora, x, KEY, frozen=base)
    (runner,) = step._engine._plans.values()
    return runner, frozen_lib.combine(lora, base)


def test_a_replicated_frozen_base_is_read_from_the_callers_buffers():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    lora, base, x = lora_problem(mesh, P())
    step = unsplit.value_and_grad(lora_loss, mesh=mesh, bitwise=True, chunk_size=2)
    runner, both = _runner(step, lora, base, x)
    assert sum(runner.plan.params_flat.lengths) == 2 * LORA_D * LORA_R  # the adapters alone
    held = runner.held(both)
    assert runner.held.gather == [False]
    mine = {s.device: s.data.unsafe_buffer_pointer() for s in base["w"].addressable_shards}
    for g, (w,) in held.items():  # each group's chunk program gets its device's own copy
        (device,) = runner.plan.group_devices(g).flat
        assert w.unsafe_buffer_pointer() == mine[device]
    assert runner.held(both) is held  # the same arrays again: not looked up again


def test_a_sharded_frozen_base_is_gathered_once_while_the_same_arrays_come_back():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    lora, base, x = lora_problem(mesh, P("data", None))
    step = unsplit.value_and_grad(lora_loss, mesh=mesh, bitwise=True, chunk_size=2)
    runner, both = _runner(step, lora, base, x)
    assert sum(runner.plan.params_flat.lengths) == 2 * LORA_D * LORA_R
    assert runner.held.gather == [True]
    held = runner.held(both)
    assert all(w.shape == (LORA_D, LORA_D) for (w,) in held.values())  # whole per group
    assert runner.held(both) is held  # no second gather for the same frozen arrays
    other = jax.tree.map(jnp.copy, both)
    assert runner.held(other) is not held  # other arrays: gathered again
    # The bits of a one-device step given the same values on the host.
    reference = unsplit.value_and_grad(lora_loss, bitwise=True, chunk_size=2)
    host = jax.device_get((lora, x, base))
    got = step(lora, x, KEY, frozen=base)
    assert unsplit.testing.bits_equal(got, reference(host[0], host[1], KEY, frozen=host[2]))
