"""The MoE recipe of docs/coupled.md: routing per example, the balancing loss over the global batch.

A top-k router whose expert capacity is counted per example (per sequence, as
MaxText does) routes each example the same way whatever the schedule; its
noise comes from the example's key. The load-balancing loss ``E * sum_e f_e *
P_e`` is a product of two global-batch means (the fraction of tokens routed to
expert e, the mean router probability of e): per-microbatch versions change
with the microbatch count. Through ``batch_loss`` it is the global one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit

E, K, D, L, B = 8, 2, 8, 6, 32  # experts, top-k, width, tokens per example, global batch
CAPACITY = 4  # tokens per expert per example (per sequence)
ALPHA = 0.01


def init():
    keys = jax.random.split(jax.random.key(0), 3)
    return {
        "router": jax.random.normal(keys[0], (D, E)) / np.sqrt(D),
        "experts": jax.random.normal(keys[1], (E, D, D)) / np.sqrt(D),
        "out": jax.random.normal(keys[2], (D,)) / np.sqrt(D),
    }


def route(params, x, key):
    """Top-k routing of ONE example's tokens, capacity per example, noise from its key."""
    logits = x @ params["router"] + 0.1 * jax.random.normal(key, (x.shape[0], E))
    probs = jax.nn.softmax(logits)
    _, top = jax.lax.top_k(probs, K)  # (L, K)
    chosen = jax.nn.one_hot(top, E).sum(axis=1)  # (L, E): 1 where a token goes
    position = jnp.cumsum(chosen, axis=0) * chosen  # the token's place in its expert's queue
    kept = jnp.where(position <= CAPACITY, chosen, 0.0)  # capacity counted within this example
    return probs, kept


def features_fn(params, example, key):
    probs, kept = route(params, example["x"], key)
    gate = (probs * kept) / jnp.maximum(jnp.sum(probs * kept, axis=1, keepdims=True), 1e-9)
    h = jnp.einsum("le,edf,ld->lf", gate, params["experts"], example["x"])
    loss = jnp.sum((h @ params["out"] - example["y"]) ** 2)
    tokens = jnp.float32(example["x"].shape[0])
    return {"loss_sum": loss, "tokens": tokens, "counts": jnp.sum(kept, axis=0),
            "probs": jnp.sum(probs, axis=0)}  # fmt: skip


def batch_loss_fn(params, f):
    tokens = jnp.sum(f["tokens"])
    fraction = jnp.sum(f["counts"], axis=0) / (K * tokens)  # f_e over the global batch
    mean_prob = jnp.sum(f["probs"], axis=0) / tokens  # P_e over the global batch
    return jnp.sum(f["loss_sum"]) / tokens + ALPHA * E * jnp.sum(fraction * mean_prob)


def data():
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(B, L, D)).astype(np.float32),
            "y": rng.normal(size=(B, L)).astype(np.float32)}  # fmt: skip


KEY = jax.random.key(7)


def reference():
    """The definition: the whole global batch on one device."""
    batch = data()
    keys = unsplit.example_keys(KEY, jnp.arange(B))

    def loss(params):
        return batch_loss_fn(params, jax.vmap(features_fn, (None, 0, 0))(params, batch, keys))

    return jax.value_and_grad(loss)(init())


@pytest.mark.parametrize(("devices", "microbatches"), [(1, 1), (1, 4), (4, 2), (8, 1)])
def test_the_global_balancing_loss_is_the_same_for_every_schedule(devices, microbatches):
    mesh = jax.make_mesh((devices,), ("data",)) if devices > 1 else None
    step = unsplit.value_and_grad(
        features_fn, batch_loss=batch_loss_fn, microbatches=microbatches, mesh=mesh
    )
    loss, grads = step(init(), data(), KEY)
    ref_loss, ref_grads = reference()
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert unsplit.testing.rel_l2(grads, ref_grads) <= 1e-5


def test_bitwise_is_bit_identical_across_schedules():
    runs = []
    for devices, microbatches in [(1, 4), (8, 1), (2, 2)]:
        mesh = jax.make_mesh((devices,), ("data",)) if devices > 1 else None
        step = unsplit.value_and_grad(
            features_fn, batch_loss=batch_loss_fn, microbatches=microbatches, mesh=mesh,
            bitwise=True, chunk_size=4,
        )  # fmt: skip
        runs.append(jax.device_get(step(init(), data(), KEY)))
    assert all(unsplit.testing.bits_equal(r, runs[0]) for r in runs[1:])


def test_negative_control_per_microbatch_balancing_changes_with_the_microbatch_count():
    batch = data()
    keys = unsplit.example_keys(KEY, jnp.arange(B))
    feats = jax.vmap(features_fn, (None, 0, 0))(init(), batch, keys)

    def per_microbatch(k):  # megablocks-style: the balancing term of each microbatch, averaged
        parts = jax.tree.map(lambda x: x.reshape(k, B // k, *x.shape[1:]), feats)
        return float(jnp.mean(jax.vmap(lambda f: batch_loss_fn(init(), f))(parts)))

    values = [per_microbatch(k) for k in (1, 2, 4)]
    assert len({round(v, 7) for v in values}) > 1


@pytest.mark.parametrize("bitwise", [False, True], ids=["default", "bitwise"])
def test_experts_sharded_over_an_expert_axis(bitwise):
    """Expert parallel: the experts' weights over an ``expert`` axis (a model axis), the
    batch over ``data``; the reference's values, grads sharded like the experts, and in
    bitwise mode the same bits at every data-parallel degree."""
    ref_loss, ref_grads = reference()
    runs = []
    for data_degree in (1, 2):
        mesh = jax.make_mesh(
            (data_degree, 2), ("data", "expert"), devices=jax.devices()[: 2 * data_degree],
            axis_types=(jax.sharding.AxisType.Auto,) * 2,
        )  # fmt: skip
        specs = {"router": P(), "experts": P("expert"), "out": P()}
        params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in init().items()}
        options = {"bitwise": True, "chunk_size": 4} if bitwise else {}
        step = unsplit.value_and_grad(
            features_fn, batch_loss=batch_loss_fn, mesh=mesh, batch_axes="data", **options
        )
        loss, grads = step(params, data(), KEY)
        assert grads["experts"].sharding.spec == P("expert")
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        assert unsplit.testing.rel_l2(grads, ref_grads) <= 1e-5
        runs.append(jax.device_get((loss, grads)))
    if bitwise:
        assert all(unsplit.testing.bits_equal(r, runs[0]) for r in runs[1:])


def token_loss(params, example, key):
    """The per-example loss of the same MoE layer (no batch-coupled balancing term)."""
    f = features_fn(params, example, key)
    return f["loss_sum"], f["tokens"]


def test_bitwise_bits_are_the_same_at_every_expert_degree():
    """Experts over an ``expert`` axis of 1, 2 and 4 devices: the combination over the
    experts is summed per canonical block (8 experts: 4 blocks of 2; degrees 1, 2, 4), so the step's
    bits do not depend on how many devices hold the experts."""
    runs = []
    for degree in (1, 2, 4):
        mesh = jax.make_mesh(
            (8 // degree, degree), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2
        )
        specs = {"router": P(), "experts": P("expert"), "out": P()}
        params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in init().items()}
        step = unsplit.value_and_grad(
            token_loss, weighted=True, mesh=mesh, batch_axes="data",
            bitwise=unsplit.Bitwise(chunk_size=4),
        )  # fmt: skip
        loss, grads = step(params, data(), KEY)
        assert grads["experts"].sharding.spec == P("expert")
        runs.append(jax.device_get((loss, grads)))
    assert all(unsplit.testing.bits_equal(r, runs[0]) for r in runs[1:])
    default = unsplit.value_and_grad(token_loss, weighted=True)(init(), data(), KEY)
    assert unsplit.testing.rel_l2(runs[0], default) <= 1e-5
