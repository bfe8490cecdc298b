"""The demo's settings, the naive schemes' building blocks, and their audit.

The audit tests build the rows from ``unsplit.demo.train`` exactly as the demo
builds them (its quick settings) and check each contrast row's problem, and
that the unsplit rows' loss and steps are clean; nothing is trained.
"""

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import unsplit
from unsplit import models
from unsplit.demo import config as demo_config
from unsplit.demo import data as demo_data
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
    config = demo_config.make("quick")
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


# ---- the audit of the demo's rows ----

CONFIG = demo_config.make("quick")


# The demo's optax code mixes int and float: standard promotion, not the tests' strict mode.
pytestmark = pytest.mark.usefixtures("standard_promotion")


@pytest.fixture(scope="module")
def demo():
    model, params, opt = dt.initial_state(CONFIG)
    data = demo_data.Dataset(CONFIG.batch_size, CONFIG.length, CONFIG.seed)
    return model, params, opt, data, jax.random.key(0)


def _update_input(data):
    """What the demo's training loop gives an update: ``(rows, ids)`` where the data has ids."""
    return data.step(0) if hasattr(data, "step") else data.batch(0)


def _kinds(findings):
    return sorted({f.kind for f in findings})


@pytest.mark.parametrize(
    ("scheme", "kinds"),
    [
        ("one_device", ["batch_draw"]),  # batch-level dropout: noise follows the position
        ("per_device_keys", ["batch_draw", "device_key"]),  # shard_prng_key, and per-device draws
        ("same_key_microbatches", ["batch_draw"]),  # T5X: one key for every microbatch
    ],
)
def test_flax_contrast_rows(demo, scheme, kinds):
    model, params, opt, data, key = demo
    update = dt.flax_update(model, opt, scheme)
    findings = unsplit.audit_step(update, params, opt.init(params), _update_input(data), key)
    assert _kinds(findings) == kinds
    if scheme == "same_key_microbatches":
        assert "the key is the same at every iteration" in findings[0].message
    if scheme == "per_device_keys":
        (device,) = [f for f in findings if f.kind == "device_key"]
        assert device.file == dt.__file__ and "shard_map" in device.message
        assert device.line in _lines_of(dt.scheme_sums)


def test_multisteps_row_is_a_mean_of_means(demo):
    model, params, opt, data, key = demo
    update, init = dt.multisteps_update(model, opt, 8)
    (finding,) = unsplit.audit_step(update, params, init(params), _update_input(data), key)
    assert finding.kind == "mean_of_means" and "MultiSteps" in finding.message
    assert finding.file == dt.__file__
    assert finding.line in _lines_of(dt.multisteps_update)


def test_unsplit_steps_of_the_demo_are_clean(demo):
    model, params, _, data, key = demo
    batch = data.batch(0)
    loss_fn = models.token_loss(model)
    for devices, microbatches in [(1, 1), (2, 4)]:
        step = dt.unsplit_step(
            CONFIG, loss_fn, devices=devices, microbatches=microbatches, bitwise=False
        )
        assert unsplit.audit_step(step, params, batch, key) == []


def test_unsplit_loss_finds_only_flax_attention_dropout(demo):
    model, params, _, data, key = demo
    batch = data.batch(0)
    findings = unsplit.audit(models.token_loss(model), params, batch, key, weighted=True)
    if _attention_fns(model, params, batch) == {nn.dot_product_attention}:
        # Flax's attention draws its (heads, L, L) dropout mask at once: padding-unstable.
        assert [(f.kind, f.file, f.line) for f in findings] == [
            ("padding_unstable", _model_file(), _attention_line())
        ]
    else:  # the demo uses unsplit's padding-stable attention: nothing left to find
        assert findings == []


def _attention_fns(model, params, batch):
    """The ``attention_fn`` of every attention module the model applies."""
    fns = set()

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, nn.MultiHeadDotProductAttention):
            fns.add(context.module.attention_fn)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        model.apply({"params": params}, batch["inputs"][0], train=False)
    assert fns, "the demo model has no attention module"
    return fns


def _attention_line():
    """The line of the test model that calls the attention module."""
    lines = inspect.getsource(inspect.getmodule(models.Transformer)).splitlines()
    matches = [i + 1 for i, text in enumerate(lines) if "MultiHeadDotProductAttention(" in text]
    assert len(matches) == 1, f"expected one attention module in the model, got lines {matches}"
    return matches[0]


def _lines_of(fn):
    source, start = inspect.getsourcelines(fn)
    return range(start, start + len(source))


def _model_file():
    return inspect.getsourcefile(models.Transformer)
