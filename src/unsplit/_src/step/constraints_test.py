"""A loss's sharding annotations mean in both modes what they mean in a plain jitted step.

Each spelling plain JAX accepts on the mesh (on Auto axes: ``with_sharding_constraint``
with a ``NamedSharding`` of the user's mesh or a bare ``P`` under ``jax.set_mesh``; on
Explicit axes: ``jax.sharding.reshard`` with either, and ``out_sharding=``), on a
``(data, seq)`` mesh (the axis shards activations only) and a ``(data, model)`` mesh
(params sharded over it), compared with ``jax.jit(jax.value_and_grad(batched_loss))``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as flax_nn
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src.step import constraints

S, D = 8, 8
CASES = [
    (axis, types, spelling)
    for axis in ("seq", "model")
    for types, spellings in (
        (AxisType.Explicit, ("reshard", "reshard_named")),
        (AxisType.Auto, ("wsc_named", "wsc_bare")),
    )
    for spelling in spellings
]


def _mesh(axis, types):
    return jax.make_mesh((2, 2), ("data", axis), axis_types=(types,) * 2, devices=jax.devices()[:4])


def _specs(axis):
    if axis == "seq":
        return {"w": P(), "o": P()}
    return {"w": P(None, "model"), "o": P("model", None)}


def _make_loss(mesh, axis, spelling):
    # The activation h is [S, D]: "seq" splits its positions, "model" its features.
    spec = P("seq", None) if axis == "seq" else P(None, "model")
    explicit = mesh.axis_types[1] == AxisType.Explicit

    def loss(p, example, key):
        h = jnp.tanh(example["x"] @ p["w"])
        if spelling == "reshard":
            h = jax.sharding.reshard(h, spec)
        elif spelling == "reshard_named":
            h = jax.sharding.reshard(h, NamedSharding(mesh, spec))
        elif spelling == "wsc_named":
            h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, spec))
        else:
            h = jax.lax.with_sharding_constraint(h, spec)
        # Tensor parallel on Explicit axes: the contraction over "model" needs its output's
        # sharding, as in plain JAX.
        out_sharding = P() if explicit and axis == "model" else None
        return jnp.mean(jnp.matmul(h, p["o"], out_sharding=out_sharding) ** 2)

    return loss


def _inputs(mesh, axis):
    rng = np.random.default_rng(0)
    params = {k: (rng.normal(size=(D, D)) * 0.5).astype(np.float32) for k in ("w", "o")}
    params = {k: jax.device_put(v, NamedSharding(mesh, _specs(axis)[k])) for k, v in params.items()}
    batch = {"x": rng.normal(size=(8, S, D)).astype(np.float32)}
    return params, batch


def _plain(loss, mesh, params, batch):
    def batched(p, b):
        return jnp.mean(jax.vmap(loss, in_axes=(None, 0, None))(p, b, None))

    with jax.set_mesh(mesh):
        b = jax.device_put(batch, NamedSharding(mesh, P("data")))
        return jax.jit(jax.value_and_grad(batched))(params, b)


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis,types,spelling", CASES)
def test_both_modes_match_a_plain_jit_step(axis, types, spelling):
    mesh = _mesh(axis, types)
    loss = _make_loss(mesh, axis, spelling)
    params, batch = _inputs(mesh, axis)
    ref = _plain(loss, mesh, params, batch)
    for options in ({}, {"bitwise": True, "chunk_size": 2}):
        step = unsplit.value_and_grad(loss, mesh=mesh, **options)
        with jax.set_mesh(mesh):
            got = step(params, batch, jax.random.key(0))
        _close(got, ref)


@pytest.mark.parametrize("types,spelling", [c[1:] for c in CASES if c[0] == "seq"])
def test_default_mode_applies_the_constraint(types, spelling):
    """Not dropped: the program constrains the activation over "seq" (which no param uses)."""
    mesh = _mesh("seq", types)
    params, batch = _inputs(mesh, "seq")
    step = unsplit.value_and_grad(_make_loss(mesh, "seq", spelling), mesh=mesh)
    with jax.set_mesh(mesh):
        text = step.lower(params, batch, jax.random.key(0)).as_text()
    constrained = [
        line for line in text.splitlines() if "sharding_constraint" in line and '"seq"' in line
    ]
    assert constrained, text[:2000]
    assert any(re.search(r"\[\{[^}]*\}, \{\"seq\"", line) for line in constrained), constrained


def test_activation_axes_lists_the_axes_the_loss_names():
    mesh = _mesh("seq", AxisType.Explicit)
    example = {"x": jax.ShapeDtypeStruct((S, D), jnp.float32)}
    params = {k: jax.ShapeDtypeStruct((D, D), jnp.float32) for k in ("w", "o")}
    found = constraints.activation_axes(
        _make_loss(mesh, "seq", "reshard"), mesh, params, example, None
    )
    assert found == (frozenset({"seq"}), frozenset())
    plain = constraints.activation_axes(
        lambda p, e, k: jnp.sum(e["x"]), mesh, params, example, None
    )
    assert plain == (frozenset(), frozenset())


def test_a_loss_without_shardings_runs_as_it_is():
    calls = []

    def loss(p, example, key):
        calls.append(1)
        return jnp.sum(example * p)

    mesh = _mesh("seq", AxisType.Explicit)
    f = constraints.retargeted(loss, mesh, keep=("seq",))
    assert float(f(jnp.float32(2.0), jnp.ones(3), None)) == 6.0
    assert len(calls) == 2  # the trace on the user's mesh, then the loss itself


class _NormedMLP(flax_nn.Module):
    """A BatchNorm between two layers, its activation constrained over "seq"."""

    @flax_nn.compact
    def __call__(self, x, train):
        h = flax_nn.Dense(D)(x)
        h = jax.lax.with_sharding_constraint(h, P("seq", None))
        return jnp.mean(flax_nn.BatchNorm(use_running_average=not train)(h) ** 2)


@pytest.mark.parametrize("bitwise", [False, True])
def test_a_dropped_batchnorm_update_is_found_in_a_loss_with_shardings(bitwise):
    # The loss runs as its jaxpr on the program's mesh (the shardings moved there), not as
    # Python: the update is found in unsplit's own trace, against what that trace returns.
    mesh = _mesh("seq", AxisType.Auto)
    net = _NormedMLP()
    with jax.set_mesh(mesh):
        variables = net.init(jax.random.key(0), jnp.ones((S, D)), train=False)
    batch = np.ones((8, S, D), np.float32)
    options = {"bitwise": True, "chunk_size": 2} if bitwise else {}

    def dropped(v, x, key):
        return net.apply(v, x, train=True, mutable=["batch_stats"])[0]

    step = unsplit.value_and_grad(dropped, mesh=mesh, **options)
    with jax.set_mesh(mesh), pytest.raises(unsplit.DroppedStateError, match="BatchNorm"):
        step(variables, batch, jax.random.key(0))

    def returned(v, x, key):  # the update comes back in aux: kept, no error
        loss, state = net.apply(v, x, train=True, mutable=["batch_stats"])
        return loss, state

    step = unsplit.value_and_grad(returned, mesh=mesh, has_aux=True, **options)
    with jax.set_mesh(mesh):
        (loss, state), _ = step(variables, batch, jax.random.key(0))
    assert np.isfinite(float(loss)) and "batch_stats" in state
