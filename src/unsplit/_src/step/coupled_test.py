"""Losses that couple examples (``batch_loss``): the global batch's loss at any schedule.

The model is CLIP-style: two towers with dropout, L2-normalized embeddings,
a symmetric InfoNCE loss with in-batch negatives and a learnable temperature
that only ``batch_loss`` uses. Every schedule (devices x microbatches, params
replicated / FSDP / tensor parallel) matches the one-device reference
``jax.value_and_grad(batch_loss(p, vmap(features_fn)(p, batch, keys)))``
within 1e-5; the naive per-microbatch loss (open_clip ``--accum-freq``) does not.
Bitwise mode's grid is in ``unsplit/_src/bitwise/coupled_test.py``.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import test_util as testing

KEY, B, TOL = testing.CLIP_KEY, testing.CLIP_B, 1e-5
init_params, make_batch = testing.clip_params, testing.clip_batch
features_fn, batch_loss_fn = testing.clip_features, testing.clip_batch_loss
batch_loss_with_aux, reference_formula = testing.clip_batch_loss_with_aux, testing.clip_reference
close = testing.clip_close


@functools.cache
def reference():
    return reference_formula(init_params(), make_batch(), KEY)


def mesh_of(devices):
    if devices == 1:
        return None
    return jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Explicit,))


@pytest.mark.parametrize("microbatches", [1, 2, 4])
@pytest.mark.parametrize("devices", [1, 2, 8])
def test_grid_matches_the_one_device_formula(devices, microbatches):
    step = unsplit.value_and_grad(
        features_fn, batch_loss=batch_loss_fn, microbatches=microbatches, mesh=mesh_of(devices)
    )
    close(step(init_params(), make_batch(), KEY), reference())


def test_negative_control_per_microbatch_losses_differ():
    # open_clip --accum-freq style: each microbatch's loss uses only its own negatives,
    # and the microbatch losses are averaged. Another function of the batch.
    params, batch, k = init_params(), make_batch(), 4
    keys = unsplit.example_keys(KEY, jnp.arange(B))

    def naive(p):
        f = jax.vmap(features_fn, in_axes=(None, 0, 0))(p, batch, keys)
        parts = [
            batch_loss_fn(p, jax.tree.map(lambda x, i=i: x[i * B // k : (i + 1) * B // k], f))
            for i in range(k)
        ]
        return sum(parts) / k

    loss, grads = jax.value_and_grad(naive)(params)
    ref_loss, ref_grads = reference()
    assert abs(float(loss) - float(ref_loss)) > 100 * TOL * abs(float(ref_loss))
    assert testing.rel_l2(grads, ref_grads) > 100 * TOL


# Explicit model axes would need the towers written for them (out_sharding of the
# contraction), as in the user's own code: tensor parallel runs on Auto axes.
EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto


@pytest.mark.parametrize(
    "layout,microbatches,axis_type",
    [
        ("fsdp", 1, EXPLICIT),
        ("fsdp", 2, EXPLICIT),
        ("fsdp", 4, AUTO),
        ("tp", 1, AUTO),
        ("tp", 2, AUTO),
        ("fsdp+tp", 2, AUTO),
    ],
)
def test_sharded_params_match_and_keep_their_shardings(layout, microbatches, axis_type):
    model = 2 if "tp" in layout else 1
    mesh = jax.make_mesh((8 // model, model), ("data", "model"), axis_types=(axis_type,) * 2)
    w1 = P("data" if "fsdp" in layout else None, "model" if "tp" in layout else None)
    w2 = P("model" if "tp" in layout else None, None)
    specs = {"w1": w1, "w2": w2}

    def place(path, x):
        name = path[-1].key
        return jax.device_put(x, NamedSharding(mesh, specs.get(name, P())))

    params = jax.tree_util.tree_map_with_path(place, init_params())
    step = unsplit.value_and_grad(
        features_fn, batch_loss=batch_loss_fn, microbatches=microbatches, mesh=mesh
    )
    loss, grads = step(params, make_batch(), KEY)
    close((loss, grads), reference())
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
        assert g.sharding == p.sharding


def test_has_aux_returns_batch_loss_aux():
    step = unsplit.value_and_grad(
        features_fn,
        batch_loss=batch_loss_with_aux,
        has_aux=True,
        microbatches=2,
        mesh=mesh_of(2),
    )
    (loss, aux), grads = step(init_params(), make_batch(), KEY)
    close((loss, grads), reference())
    keys = unsplit.example_keys(KEY, jnp.arange(B))
    f = jax.vmap(features_fn, in_axes=(None, 0, 0))(init_params(), make_batch(), keys)
    assert float(aux["accuracy"]) == float(batch_loss_with_aux(init_params(), f)[1]["accuracy"])


def test_record_ids_and_inside_the_users_jit():
    ids = jnp.arange(B) * 7 + 1000
    step = unsplit.value_and_grad(
        features_fn, batch_loss=batch_loss_fn, microbatches=2, mesh=mesh_of(2)
    )
    out = jax.jit(step)(init_params(), make_batch(), KEY, ids)
    close(out, reference_formula(init_params(), make_batch(), KEY, ids))


def test_second_call_does_not_retrace():
    traces = []

    def counted(params, example, key):
        traces.append(1)
        return features_fn(params, example, key)

    step = unsplit.value_and_grad(counted, batch_loss=batch_loss_fn, microbatches=2)
    step(init_params(), make_batch(), KEY)
    first = len(traces)
    step(init_params(), make_batch(), jax.random.fold_in(KEY, 1))
    assert len(traces) == first


def test_train_step_runs_a_coupled_step():
    import optax

    step = unsplit.value_and_grad(features_fn, batch_loss=batch_loss_fn, microbatches=2)
    optimizer = optax.sgd(0.1)
    params = init_params()
    train = unsplit.train_step(step, optimizer)
    loss, new_params, _ = train(params, optimizer.init(params), make_batch(), KEY)
    assert abs(float(loss) - float(reference()[0])) <= TOL * abs(float(reference()[0]))
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, init_params(), reference()[1])
    assert testing.rel_l2(new_params, expected) <= TOL


def test_weighted_is_refused_with_a_fix():
    with pytest.raises(ValueError, match=r"expected weighted=False.*got weighted=True.*Fix"):
        unsplit.value_and_grad(features_fn, batch_loss=batch_loss_fn, weighted=True)


def test_features_that_are_not_arrays_are_refused_with_a_fix():
    def bad(params, example, key):
        return {"image": features_fn(params, example, key)["image"], "name": "clip"}

    step = unsplit.value_and_grad(bad, batch_loss=batch_loss_fn)
    with pytest.raises(TypeError, match=r"features\['name'\] is str.*Fix"):
        step(init_params(), make_batch(), KEY)


def test_integer_features_are_refused_with_a_fix():
    def counts(params, example, key):
        return {**features_fn(params, example, key), "n": jnp.int32(1)}

    step = unsplit.value_and_grad(counts, batch_loss=batch_loss_fn)
    with pytest.raises(TypeError, match=r"features\['n'\] has dtype int32.*Fix"):
        step(init_params(), make_batch(), KEY)


def test_a_batch_loss_that_is_not_a_scalar_is_refused_with_a_fix():
    step = unsplit.value_and_grad(features_fn, batch_loss=lambda p, f: f["image"] @ f["text"].T)
    with pytest.raises(TypeError, match=r"scalar loss of the global batch; got an array.*Fix"):
        step(init_params(), make_batch(), KEY)


def test_a_batch_loss_without_its_aux_pair_is_refused_with_a_fix():
    step = unsplit.value_and_grad(features_fn, batch_loss=batch_loss_fn, has_aux=True)
    with pytest.raises(
        TypeError,
        match=r"has_aux=True, batch_loss must return a pair \(loss, aux\) for the global "
        r"batch; got an array of shape \(\).*Fix: return e.g. \(loss, ",
    ):
        step(init_params(), make_batch(), KEY)


def test_first_call_audits_features_fn():
    fixed = jax.random.key(5)

    def foreign(params, example, key):
        return features_fn(params, example, fixed)

    step = unsplit.value_and_grad(foreign, batch_loss=batch_loss_fn)
    with pytest.raises(unsplit.AuditError, match="foreign_key"):
        step(init_params(), make_batch(), KEY)
