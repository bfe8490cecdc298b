"""The audit of the demo: each contrast row's problem, and the unsplit rows' loss and steps.

The rows are built from ``unsplit.demo.train`` exactly as the demo builds them
(its quick settings); nothing is trained.
"""

import inspect

import flax.linen as nn
import jax
import pytest

import unsplit
from unsplit._src.models import transformer as tf
from unsplit.demo import config as demo_config
from unsplit.demo import data as demo_data
from unsplit.demo import train as demo_train

CONFIG = demo_config.make(quick=True)


@pytest.fixture(autouse=True)
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # the demo's optax code mixes int and float
        yield


@pytest.fixture(scope="module")
def demo():
    model, params, opt = demo_train.initial_state(CONFIG)
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
    update = demo_train.flax_update(model, opt, scheme)
    findings = unsplit.audit_step(update, params, opt.init(params), _update_input(data), key)
    assert _kinds(findings) == kinds
    if scheme == "same_key_microbatches":
        assert "the key is the same at every iteration" in findings[0].message
    if scheme == "per_device_keys":
        (device,) = [f for f in findings if f.kind == "device_key"]
        assert device.file == demo_train.__file__ and "shard_map" in device.message
        assert device.line in _lines_of(demo_train.flax_update)


def test_multisteps_row_is_a_mean_of_means(demo):
    model, params, opt, data, key = demo
    update, init = demo_train.multisteps_update(model, opt, 8)
    (finding,) = unsplit.audit_step(update, params, init(params), _update_input(data), key)
    assert finding.kind == "mean_of_means" and "MultiSteps" in finding.message
    assert finding.file == demo_train.__file__
    assert finding.line in _lines_of(demo_train.multisteps_update)


def test_unsplit_steps_of_the_demo_are_clean(demo):
    model, params, _, data, key = demo
    batch = data.batch(0)
    loss_fn = tf.token_loss(model)
    for devices, microbatches in [(1, 1), (2, 4)]:
        step = demo_train.unsplit_step(
            CONFIG, loss_fn, devices=devices, microbatches=microbatches, bitwise=False
        )
        assert unsplit.audit_step(step, params, batch, key) == []


def test_unsplit_loss_finds_only_flax_attention_dropout(demo):
    model, params, _, data, key = demo
    batch = data.batch(0)
    findings = unsplit.audit(tf.token_loss(model), params, batch, key, weighted=True)
    if _attention_fns(model, params, batch) == {nn.dot_product_attention}:
        # Flax's attention draws its (heads, L, L) dropout mask at once: padding-unstable.
        assert [(f.kind, f.file, f.line) for f in findings] == [
            ("padding_unstable", tf.__file__, _attention_line())
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
    lines = inspect.getsource(tf).splitlines()
    matches = [i + 1 for i, text in enumerate(lines) if "MultiHeadDotProductAttention(" in text]
    assert len(matches) == 1, f"expected one attention module in the model, got lines {matches}"
    return matches[0]


def _lines_of(fn):
    source, start = inspect.getsourcelines(fn)
    return range(start, start + len(source))
