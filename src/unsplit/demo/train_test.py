"""The demo's settings and the naive schemes' building blocks."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from unsplit.demo import config as demo_config
from unsplit.demo import run as demo
from unsplit.demo import train as dt


def test_snapshot_steps_end_at_the_last_step():
    config = demo_config.DemoConfig(steps=50, points=7)
    steps = config.snapshot_steps()
    assert steps[-1] == 50 and steps == sorted(set(steps)) and len(steps) >= 7


def test_check_lists_every_problem_with_the_fix():
    config = demo_config.DemoConfig(steps=1, batch_size=20, width=30, heads=4)
    with pytest.raises(ValueError, match="steps must be >= 2") as e:
        config.check()
    assert "multiple of 8" in str(e.value) and "multiple of heads" in str(e.value)


def test_unknown_scheme_is_refused():
    config = demo_config.make(quick=True)
    model, _, opt = dt.initial_state(config)
    with pytest.raises(ValueError, match="unknown scheme"):
        dt.flax_update(model, opt, "per_example")


def test_same_key_microbatches_get_identical_masks():
    # Why the T5X row is wrong: batch-level dropout with one key is prefix-stable, so
    # two microbatches of 2 examples get the same mask, where one batch of 4 has 4.
    layer = nn.Dropout(0.5, deterministic=False)
    key = jax.random.key(0)
    x = jnp.ones((4, 16))
    whole = layer.apply({}, x, rngs={"dropout": key})
    half = layer.apply({}, x[:2], rngs={"dropout": key})
    np.testing.assert_array_equal(half, whole[:2])
    assert not np.array_equal(whole[:2], whole[2:])


def test_inert_leaves_are_the_key_biases_and_compare_skips_them():
    config = demo_config.make(quick=True, layers=2)
    _, params, _ = dt.initial_state(config)
    inert = demo.inert_leaves(params)
    assert len(inert) == 2 and all(p.endswith("['key']['bias']") for p in inert)
    leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
    moved = [x.copy() for x in leaves]
    moved[0] = moved[0] + np.float32(0.5)
    curve, everything, same = demo.compare({1: moved}, {1: leaves}, skip={0})
    assert curve == [[1, 0.0]] and everything == 0.5 and not same
    curve, _, same = demo.compare({1: leaves}, {1: leaves})
    assert curve == [[1, 0.0]] and same
