"""One program on whole arrays: updates and sums whose bits do not follow the sharding."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src.bitwise.update import CanonicalUpdate, GroupedUpdate

VALUES = jax.random.normal(jax.random.key(0), (4096, 3))


def sharded(x, devices):
    mesh = jax.make_mesh((devices,), ("data",))
    return jax.device_put(x, NamedSharding(mesh, P("data")))


def test_an_update_keeps_each_leaf_sharding_and_runs_once_per_call():
    mesh = jax.make_mesh((4,), ("data",))
    w = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
    count = jax.device_put(jnp.int32(0), NamedSharding(mesh, P()))
    update = CanonicalUpdate(lambda w, c, g: (w - g, c + 1), mesh, outputs=2)
    new_w, new_count = update(w, count, jnp.ones(8))
    assert new_w.sharding == w.sharding and new_count.sharding == count.sharding
    assert new_w.tolist() == [x - 1.0 for x in range(8)] and int(new_count) == 1


def test_only_the_update_device_holds_the_whole_arrays():
    # One process: the leaves are copied whole onto one device (not replicated on every
    # device), and each device gets back only its shard.
    mesh = jax.make_mesh((4,), ("data",))
    n = 4096
    w = jax.device_put(jnp.arange(float(n)), NamedSharding(mesh, P("data")))
    g = jax.device_put(jnp.ones(n), NamedSharding(mesh, P("data")))
    update = CanonicalUpdate(lambda w, g: (w - g,), mesh, outputs=1)

    def held():  # bytes of distinct buffers per device (shard views share their buffer)
        buffers = {d: {} for d in mesh.devices.flat}
        for a in jax.live_arrays():
            for s in a.addressable_shards:
                if s.device in buffers:
                    buffers[s.device][s.data.unsafe_buffer_pointer()] = s.data.nbytes
        return {d: sum(b.values()) for d, b in buffers.items()}

    before, during = held(), {}
    jitted = update.fn

    def spy(*args):
        during.update(held())
        return jitted(*args)

    update.fn = spy
    (new_w,) = update(w, g)
    added = {d: during[d] - before[d] for d in mesh.devices.flat}
    assert added[update.device] >= 2 * n * 4  # w and g whole
    assert all(added[d] == 0 for d in mesh.devices.flat if d != update.device), added
    assert [s.data.shape for s in new_w.addressable_shards] == [(n // 4,)] * 4
    assert new_w.tolist() == [x - 1.0 for x in range(n)]


def test_a_grouped_update_keeps_every_leaf_in_shards():
    # FSDP groups (chunk_axes): each group updates its own shards; no device holds more than
    # its shards of the inputs, and the layout comes back as it was.
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    n = 4096
    w = jax.device_put(jnp.arange(float(n)), NamedSharding(mesh, P("fsdp")))
    g = jax.device_put(jnp.ones(n), NamedSharding(mesh, P("fsdp")))
    count = jax.device_put(jnp.int32(0), NamedSharding(mesh, P()))
    update = GroupedUpdate(lambda w, c, g: (w - g, c + 1), mesh, outputs=2, axes=("fsdp",))
    assert len(update.groups) == 2
    new_w, new_count = update(w, count, g)
    assert new_w.sharding == w.sharding and new_count.sharding == count.sharding
    assert [s.data.shape for s in new_w.addressable_shards] == [(n // 4,)] * 8
    assert new_w.tolist() == [x - 1.0 for x in range(n)] and int(new_count) == 1
    # A leaf sharded over another axis too is gathered over it (exact) and comes back so.
    v = jax.device_put(jnp.arange(8.0).reshape(2, 4), NamedSharding(mesh, P("data", "fsdp")))
    (new_v,) = GroupedUpdate(lambda v: (v * 2,), mesh, outputs=1, axes=("fsdp",))(v)
    assert (
        new_v.sharding == v.sharding
        and new_v.tolist() == (2 * np.arange(8.0)).reshape(2, 4).tolist()
    )


def test_a_replicated_update_runs_on_every_device_with_the_bits_of_one():
    # LoRA adapters: every leaf whole on every device. No gather onto one device and no copy
    # back: each device runs the one-device program on its own copy, in one launch.
    mesh = jax.make_mesh((8,), ("data",))
    replicated = NamedSharding(mesh, P())
    w, m, g = (
        jax.device_put(jax.random.normal(jax.random.key(i), (32, 4)), replicated) for i in range(3)
    )

    def adam_like(w, m, g):
        m = 0.9 * m + 0.1 * g
        return w - 0.01 * m / (jnp.linalg.norm(m) + 1e-8), m

    update = CanonicalUpdate(adam_like, mesh, outputs=2)
    new_w, new_m = update(w, m, g)
    assert update.everywhere._programs  # the one-launch path
    assert new_w.sharding == w.sharding and new_m.sharding == m.sharding
    want = jax.jit(adam_like)(*(a.addressable_data(0) for a in (w, m, g)))  # on one device
    for got, expected in zip((new_w, new_m), want, strict=True):
        for shard in got.addressable_shards:
            assert np.asarray(shard.data).tobytes() == np.asarray(expected).tobytes()


def test_a_grouped_update_takes_params_that_are_a_list():
    # Params as a list of matrices (a plain MLP's): the group program's specs per leaf are
    # not confused with the user's list (it raised a pytree structure error in shard_map).
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    fsdp = NamedSharding(mesh, P("fsdp"))
    ws = [jax.device_put(VALUES[: 8 * (i + 1)] * (i + 1), fsdp) for i in range(3)]
    gs = [jax.device_put(jnp.ones_like(w), fsdp) for w in ws]

    def update(ws, gs):
        norm = jnp.sqrt(sum(jnp.sum(g**2) for g in gs))
        return ([w - 0.1 * g / norm for w, g in zip(ws, gs, strict=True)],)

    (new,) = GroupedUpdate(update, mesh, outputs=1, axes=("fsdp",))(ws, gs)
    (want,) = jax.jit(update)(jax.device_get(ws), jax.device_get(gs))
    assert isinstance(new, list) and [w.sharding for w in new] == [fsdp] * 3
    for got, expected in zip(new, want, strict=True):
        assert np.allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=0)
