"""A JAX setting made by a context manager around the step reaches the loss, in both modes.

The loss of an FSDP group's chunk program (bitwise mode, ``chunk_axes``) is traced
in a thread of its own when it holds sharding annotations (issue 39, item 3): there
a setting made around the call (``jax.default_matmul_precision("highest")``,
``jax.numpy_dtype_promotion("standard")``) was not set. The loss saw the process's
values (the first tests here fail without the fix: a trace saw no precision, a loss
that needs standard promotion failed). Its dots still came out at the caller's
precision on JAX 0.10: the per-example ``vmap`` and differentiation emit every dot
again in the calling thread, which reads the precision anew; the HLO tests pin that.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src.bitwise import programs
from unsplit._src.step import settings

AUTO = AxisType.Auto
KEY = jax.random.key(0)


def test_in_thread_carries_the_callers_settings():
    with jax.default_matmul_precision("highest"), jax.numpy_dtype_promotion("standard"):
        got = settings.in_thread(
            lambda: (jax.config.jax_default_matmul_precision, jax.config.jax_numpy_dtype_promotion)
        )
    assert got == ("highest", "standard")
    # Outside the block the thread sees the process's own values again.
    assert settings.in_thread(lambda: jax.config.jax_default_matmul_precision) is None


def test_the_settings_are_those_jax_offers_as_context_managers():
    states = settings._states()
    assert jax.default_matmul_precision in states and jax.numpy_dtype_promotion in states
    assert jax.enable_x64 in states and jax.debug_nans in states
    assert all(callable(s) and hasattr(s, "value") for s in states)


def test_a_thread_already_at_the_value_enters_nothing():
    with jax.default_matmul_precision("highest"):
        carried = settings.current()
        with settings.applied(carried):  # the same thread: every value equal
            assert jax.config.jax_default_matmul_precision == "highest"
    assert jax.config.jax_default_matmul_precision is None


# ---- the loss of a step, in both modes and every layout ----


def mesh_for(layout: str):
    if layout == "fsdp groups":
        return jax.make_mesh((2, 2, 2), ("data", "fsdp", "seq"), axis_types=(AUTO,) * 3)
    return jax.make_mesh((4, 2), ("data", "seq"), axis_types=(AUTO,) * 2)


def recording_loss(mesh, seen: list):
    """A loss whose traces record the matmul precision they see; with a mesh, with a
    sharding annotation on it (each example's features over ``seq``)."""

    def loss(w, x, key):
        seen.append(jax.config.jax_default_matmul_precision)
        if mesh is not None:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("seq")))
        keep = jax.random.bernoulli(key, 0.9, x.shape)
        # A dot of the example alone (no gradient flows through it: differentiation does
        # not emit it again, so it keeps the precision its trace saw).
        gram = jnp.mean(x @ x.T)
        return jnp.sum(jnp.tanh(jnp.where(keep, x, 0.0) @ w) ** 2) * gram

    return loss


LAYOUTS = {
    "default, no mesh": (None, {}),
    "default, mesh": ("mesh", {}),
    "bitwise, no mesh": (None, dict(bitwise=True)),
    "bitwise, mesh": ("mesh", dict(bitwise=True)),
    "bitwise, fsdp groups": (
        "fsdp groups",
        dict(bitwise=True, batch_axes=("data", "fsdp"), chunk_axes="fsdp"),
    ),
}


def make_step(layout: str, seen: list):
    mesh_name, options = LAYOUTS[layout]
    mesh = None if mesh_name is None else mesh_for(mesh_name)
    return unsplit.value_and_grad(recording_loss(mesh, seen), mesh=mesh, **options)


W = jax.random.normal(jax.random.key(1), (8, 8))
X = jax.random.normal(jax.random.key(2), (32, 4, 8))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_precision_set_around_the_call_reaches_every_trace_of_the_loss(layout):
    seen = []
    step = make_step(layout, seen)
    with jax.default_matmul_precision("highest"):
        jax.block_until_ready(step(W, X, KEY))
    assert seen and set(seen) == {"highest"}, seen


def chunk_program_text(step) -> str:
    """The compiled text of a bitwise step's (first group's) chunk program."""
    state, _ = step._engine.prepare(W, X, KEY)
    executable = next(iter(state.executables.values()))
    return executable.as_text()


def test_the_fsdp_groups_chunk_program_runs_its_dots_at_that_precision(monkeypatch):
    # Off CPU a chunk program's dots are compiled as traced; on CPU unsplit rewrites them
    # (canonical_dots), which reads the precision again: measured here as off CPU.
    monkeypatch.setattr(programs, "CANONICAL_DOTS", False)
    seen = []
    step = make_step("bitwise, fsdp groups", seen)
    with jax.default_matmul_precision("highest"):
        jax.block_until_ready(step(W, X, KEY))
    dots = re.findall(r"= f32\[[^\]]*\]\S* dot\([^\n]*", chunk_program_text(step))
    assert len(dots) >= 3  # the example's own, the forward's and the weights' gradient's
    assert all("operand_precision={highest,highest}" in d for d in dots), dots


def test_the_default_setting_leaves_the_dots_at_default_precision(monkeypatch):
    monkeypatch.setattr(programs, "CANONICAL_DOTS", False)
    step = make_step("bitwise, fsdp groups", [])
    jax.block_until_ready(step(W, X, KEY))
    text = chunk_program_text(step)
    assert " dot(" in text and "operand_precision={highest" not in text


def test_the_bits_at_highest_are_the_same_on_every_schedule():
    seen, outs = [], []
    for data, fsdp in ((2, 2), (1, 2)):
        devices = np.array(jax.devices()[: data * fsdp * 2]).reshape(data, fsdp, 2)
        m = jax.sharding.Mesh(devices, ("data", "fsdp", "seq"), axis_types=(AUTO,) * 3)
        step = unsplit.value_and_grad(
            recording_loss(m, seen),
            mesh=m,
            batch_axes=("data", "fsdp"),
            chunk_axes="fsdp",
            bitwise=True,
        )
        with jax.default_matmul_precision("highest"):
            outs.append(jax.device_get(step(W, X, KEY)))
    assert unsplit.testing.bits_equal(outs[0], outs[1])
    assert set(seen) == {"highest"}


def test_the_dtype_promotion_set_around_the_call_reaches_the_loss():
    # The tests run JAX's strict promotion (conftest); a loss that adds an int32 array to
    # float32 needs the standard one, set around the call, as a user would.
    mesh = mesh_for("fsdp groups")

    def loss(w, x, key):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("seq")))
        return jnp.sum(jnp.tanh((x + jnp.arange(x.shape[-1])[None]) @ w) ** 2)

    _, options = LAYOUTS["bitwise, fsdp groups"]
    step = unsplit.value_and_grad(loss, mesh=mesh, **options)
    with jax.numpy_dtype_promotion("standard"):
        loss_value, _ = step(W, X, KEY)
    with jax.numpy_dtype_promotion("standard"):
        want = jnp.mean(
            jax.vmap(lambda x: jnp.sum(jnp.tanh((x + jnp.arange(8)[None]) @ W) ** 2))(X)
        )
    np.testing.assert_allclose(loss_value, want, rtol=1e-5)
