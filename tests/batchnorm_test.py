"""The BatchNorm recipe of docs/coupled.md: ghost batches as examples, pooled running statistics.

An "example" is a fixed group of G consecutive rows (global ids g*G ... g*G+G-1): the
batch is reshaped to (B/G, G, ...) so no microbatch or device can split a group, and
Flax's ``nn.BatchNorm`` normalizes each group over itself (ghost batch normalization),
the same way whatever the schedule. Its running statistics are pooled over the whole
global batch in ``batch_loss`` (the pooled mean and the pooled variance, not a mean of
the groups' variances) and updated as Flax would update them on one device over the
whole global batch.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import unsplit

G, B, D = 4, 32, 5  # rows per group (ghost batch), global batch in rows, features
MOMENTUM = 0.9


class Model(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.Dense(8)(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM)(h)
        h = nn.Dropout(0.1, deterministic=not train)(nn.relu(h))
        return nn.Dense(1)(h)[..., 0]


MODEL = Model()


def batchnorm_inputs(fn):
    """``fn()`` and the input of every BatchNorm it calls (by the layer's path)."""
    seen = {}

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, nn.BatchNorm) and context.method_name == "__call__":
            seen["/".join(context.module.path)] = args[0]
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        out = fn()
    return out, seen


def features_fn(variables, group, key):
    """ONE group of G rows: its loss sum and, per BatchNorm, the sums of x and x**2."""

    def apply():
        return MODEL.apply(variables, group["x"], train=True, rngs={"dropout": key},
                           mutable=["batch_stats"])  # fmt: skip

    (pred, update), inputs = batchnorm_inputs(apply)
    stats = {
        name: {"sum": jnp.sum(x, axis=0), "sum_sq": jnp.sum(x * x, axis=0)}
        for name, x in inputs.items()
    }
    loss_sum = jnp.sum((pred - group["y"]) ** 2)
    # Flax's own update (from this group alone) is returned, so nothing is dropped without a
    # word; batch_loss_fn pools the statistics of every group instead.
    return {"loss_sum": loss_sum, "rows": jnp.float32(G), "stats": jax.lax.stop_gradient(stats),
            "group_update": update["batch_stats"]}  # fmt: skip


def batch_loss_fn(variables, f):
    """The mean squared error over every row, and the pooled statistics as aux."""
    rows = jnp.sum(f["rows"])
    pooled = {}
    for name, s in f["stats"].items():
        mean = jnp.sum(s["sum"], axis=0) / rows
        var = jnp.sum(s["sum_sq"], axis=0) / rows - mean * mean  # Flax's fast variance
        pooled[name] = {"mean": mean, "var": var}
    return jnp.sum(f["loss_sum"]) / rows, pooled


def updated_batch_stats(batch_stats, pooled):
    """Flax's running-average update, with the pooled statistics of the global batch."""
    out = {}
    for name, s in pooled.items():
        old = batch_stats[name]
        out[name] = {k: MOMENTUM * old[k] + (1 - MOMENTUM) * s[k] for k in ("mean", "var")}
    return out


def data():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(B, D)).astype(np.float32)
    y = rng.normal(size=(B,)).astype(np.float32)
    return {"x": x.reshape(B // G, G, D), "y": y.reshape(B // G, G)}  # one example = G rows


VARIABLES = MODEL.init(jax.random.key(0), jnp.ones((G, D)), train=False)
KEY = jax.random.key(4)


def step_for(devices, microbatches, bitwise=False):
    mesh = jax.make_mesh((devices,), ("data",)) if devices > 1 else None
    return unsplit.value_and_grad(features_fn, batch_loss=batch_loss_fn, has_aux=True,
                                  microbatches=microbatches, mesh=mesh, bitwise=bitwise,
                                  chunk_size=1 if bitwise else None)  # fmt: skip


def reference():
    batch = data()
    keys = unsplit.example_keys(KEY, jnp.arange(B // G))

    def loss(variables):
        f = jax.vmap(features_fn, (None, 0, 0))(variables, batch, keys)
        return batch_loss_fn(variables, f)

    return jax.value_and_grad(loss, has_aux=True)(VARIABLES)


@pytest.mark.parametrize(("devices", "microbatches"), [(1, 1), (1, 4), (4, 2), (8, 1)])
def test_ghost_batches_and_pooled_statistics_are_the_same_for_every_schedule(devices, microbatches):
    (loss, pooled), grads = step_for(devices, microbatches)(VARIABLES, data(), KEY)
    (ref_loss, ref_pooled), ref_grads = reference()
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert unsplit.testing.rel_l2(grads["params"], ref_grads["params"]) <= 1e-5
    assert unsplit.testing.rel_l2(pooled, ref_pooled) <= 1e-6


def test_running_statistics_are_flax_on_one_device_over_the_whole_global_batch():
    (_, pooled), _ = step_for(4, 2)(VARIABLES, data(), KEY)
    ours = updated_batch_stats(VARIABLES["batch_stats"], pooled)
    # Flax itself, one device, the whole global batch as one BatchNorm batch.
    whole = data()["x"].reshape(B, D)
    _, flax_update = MODEL.apply(VARIABLES, whole, train=True, rngs={"dropout": KEY},
                                 mutable=["batch_stats"])  # fmt: skip
    for name in ours:
        for k in ("mean", "var"):
            np.testing.assert_allclose(ours[name][k], flax_update["batch_stats"][name][k],
                                       rtol=1e-5, atol=1e-6)  # fmt: skip
    # Not a mean of the groups' variances: that one differs.
    groups = data()["x"] @ VARIABLES["params"]["Dense_0"]["kernel"]
    mean_of_vars = jnp.mean(jnp.var(groups, axis=1), axis=0)
    assert not np.allclose(mean_of_vars, pooled["BatchNorm_0"]["var"], rtol=1e-3)


def test_bitwise_is_bit_identical_across_schedules():
    runs = [jax.device_get(step_for(d, k, bitwise=True)(VARIABLES, data(), KEY))
            for d, k in [(1, 1), (8, 1), (2, 2)]]  # fmt: skip
    assert all(unsplit.testing.bits_equal(r, runs[0]) for r in runs[1:])


def flat_rows():
    return jax.tree.map(lambda x: x.reshape(B, *x.shape[2:]), data())


@pytest.mark.parametrize(("devices", "microbatches"), [(1, 1), (4, 2)])
def test_group_size_on_a_flat_batch_is_the_reshaped_recipe(devices, microbatches):
    # group_size=G: the step groups the rows itself (ids are the rows' ids).
    mesh = jax.make_mesh((devices,), ("data",)) if devices > 1 else None
    step = unsplit.value_and_grad(features_fn, batch_loss=batch_loss_fn, has_aux=True,
                                  microbatches=microbatches, mesh=mesh, group_size=G)  # fmt: skip
    (loss, pooled), grads = step(VARIABLES, flat_rows(), KEY, ids=np.arange(B))
    (ref_loss, ref_pooled), ref_grads = reference()
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert unsplit.testing.rel_l2(grads["params"], ref_grads["params"]) <= 1e-5
    assert unsplit.testing.rel_l2(pooled, ref_pooled) <= 1e-6


def test_group_size_in_bitwise_mode_gives_the_recipe_bits():
    step = unsplit.value_and_grad(features_fn, batch_loss=batch_loss_fn, has_aux=True,
                                  mesh=jax.make_mesh((8,), ("data",)), bitwise=True,
                                  chunk_size=1, group_size=G)  # fmt: skip
    out = jax.device_get(step(VARIABLES, flat_rows(), KEY))
    assert unsplit.testing.bits_equal(out, jax.device_get(step_for(1, 1, bitwise=True)(
        VARIABLES, data(), KEY)))  # fmt: skip


def test_a_schedule_that_would_split_a_group_is_refused():
    # 32 rows over 8 devices x 2 microbatches: 2 rows per piece, half a group of 4.
    step = unsplit.value_and_grad(features_fn, batch_loss=batch_loss_fn, has_aux=True,
                                  microbatches=2, mesh=jax.make_mesh((8,), ("data",)),
                                  group_size=G)  # fmt: skip
    with pytest.raises(ValueError, match=r"would split a group.*2 rows each.*multiple of 4"):
        step(VARIABLES, flat_rows(), KEY)


def test_a_plain_batchnorm_in_a_per_example_loss_is_refused_naming_the_recipe():
    def loss_fn(variables, row, key):
        pred, _ = MODEL.apply(variables, row["x"][None], train=True, rngs={"dropout": key},
                              mutable=["batch_stats"])  # fmt: skip
        return jnp.sum((pred - row["y"]) ** 2)

    rows = jax.tree.map(lambda x: x.reshape(B, *x.shape[2:]), data())
    with pytest.raises(
        unsplit.DroppedStateError,
        match=r"batch_loss.*Losses that couple examples guide.*coupled/#recipe-batchnorm",
    ):
        unsplit.value_and_grad(loss_fn)(VARIABLES, rows, KEY)
