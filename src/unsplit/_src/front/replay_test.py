"""Replaying a recorded step on another layout: per-leaf digests, the first difference."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import unsplit
from unsplit._src import test_util as tu
from unsplit._src.bitwise.blocked import chunk
from unsplit._src.models import transformer as tf

CONFIG = tf.TransformerConfig(vocab=32, length=8, width=32, heads=16, layers=1)
MODEL = tf.Transformer(CONFIG)
PARAMS = tf.init_params(MODEL)
BATCH = jax.tree.map(np.asarray, tf.synthetic_batch(CONFIG, 16, seed=2))
LOSS = tf.token_loss(MODEL)
KEY = jax.random.key(11)


def at(data, model, bitwise=True, params=PARAMS):
    mesh = jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[: data * model])  # fmt: skip
    placed = tu.replicated(params, mesh, tu.megatron_specs(params))
    options = unsplit.Bitwise(chunk_size=4) if bitwise else False
    return unsplit.value_and_grad(LOSS, weighted=True, mesh=mesh, bitwise=options), placed


@pytest.fixture(scope="module")
def recorded():
    step, params = at(4, 2)
    return unsplit.record_step(step, params, BATCH, KEY, step_number=3)


@pytest.mark.parametrize(("data", "model"), [(1, 8), (4, 1), (1, 1)])
def test_a_step_recorded_at_model_degree_2_replays_bit_for_bit(recorded, data, model, tmp_path):
    path = tmp_path / "step3.json"
    recorded.save(str(path))
    step, params = at(data, model)
    report = unsplit.replay_step(step, params, BATCH, KEY, against=unsplit.StepRecord.load(path))
    assert report.match and report.first_difference is None, str(report)
    assert "every leaf is bit-identical" in str(report)
    assert report.recorded_layout["mesh"] == {"data": 4, "model": 2}


def test_other_params_are_another_step_and_the_report_says_which_input(recorded):
    params = jax.tree.map(lambda x: x, PARAMS)
    params["pos"] = params["pos"] + 1.0
    step, placed = at(4, 2, params=params)
    report = unsplit.replay_step(step, placed, BATCH, KEY, against=recorded)
    assert not report.inputs_match
    assert report.first_difference == "['inputs']['params']['pos']"
    assert "not the recorded step" in str(report)


def test_xla_partitioning_at_another_degree_names_the_first_differing_output(recorded, monkeypatch):
    monkeypatch.setattr(chunk, "ENABLED", False)  # the group program left to XLA
    step, params = at(1, 8)
    report = unsplit.replay_step(step, params, BATCH, KEY, against=recorded)
    assert report.inputs_match and not report.match
    assert report.first_difference.startswith("['outputs']")
    assert f"first differing output leaf: {report.first_difference}" in str(report)


def test_a_step_with_other_bitwise_settings_is_refused(recorded):
    step, params = at(4, 2, bitwise=False)
    with pytest.raises(ValueError, match=r"settings \{'bitwise': False\} .* Fix: build the step"):
        unsplit.replay_step(step, params, BATCH, KEY, against=recorded)


def test_digests_name_every_leaf_and_change_with_one_bit():
    x = np.zeros(4, np.float32)
    y = x.copy()
    y.view(np.uint32)[2] = 1  # the smallest subnormal
    a, b = unsplit.testing.digests({"x": x}), unsplit.testing.digests({"x": y})
    assert list(a) == ["['x']"] and a != b
