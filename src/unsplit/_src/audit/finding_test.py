"""finding.py: which frames are the user's, and which findings refuse a step (``raise_for``):
findings that break schedule invariance raise; padding_unstable, which matters only when an
example is padded to other lengths, warns once and the step runs."""

import os
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import unsplit
from unsplit._src.audit import finding as audit_finding

KEY = jax.random.key(0)


def test_user_frames_skip_libraries_but_not_models():
    assert audit_finding.is_user_file(__file__)
    assert not audit_finding.is_user_file(jax.__file__)
    assert not audit_finding.is_user_file(nn.__file__)
    assert not audit_finding.is_user_file(os.__file__)
    src = os.path.dirname(os.path.dirname(audit_finding.__file__))  # unsplit/_src
    assert not audit_finding.is_user_file(os.path.join(src, "audit", "keys.py"))
    assert not audit_finding.is_user_file(os.path.join(src, "keys.py"))
    assert not audit_finding.is_user_file(os.path.join(src, "dropout", "linen.py"))
    for model in ("models/transformer.py", "models/specs.py", "test_util.py"):
        path = os.path.join(src, *model.split("/"))
        assert os.path.isfile(path), f"{model} moved: update finding._UNSPLIT_USER_FILES"
        assert audit_finding.is_user_file(path)


class _Attention(nn.Module):
    """Flax's attention dropout: a (heads, L, L) mask whose bits change with L."""

    @nn.compact
    def __call__(self, x):
        attention = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1)
        return attention(x, x, deterministic=False)  # expect: padding_unstable


def _attention_problem():
    model = _Attention()
    params = model.init(jax.random.key(1), jnp.ones((8, 4)))
    batch = np.asarray(jax.random.normal(jax.random.key(2), (8, 8, 4)))  # packed: fixed length

    def loss_fn(p, x, key):
        return jnp.sum(model.apply(p, x, rngs={"dropout": key}) ** 2)

    return loss_fn, params, batch


def _marked_line():
    with open(__file__) as f:
        return next(
            i + 1 for i, line in enumerate(f) if line.endswith("# expect: padding_unstable\n")
        )


def test_audit_true_warns_on_flax_attention_dropout_with_fixed_length_inputs_and_runs():
    loss_fn, params, batch = _attention_problem()
    (found,) = unsplit.audit(loss_fn, params, batch, KEY)
    assert found.kind == "padding_unstable" and found.line == _marked_line()
    step = unsplit.value_and_grad(loss_fn, audit=True)
    with pytest.warns(audit_finding.PaddingWarning) as caught:
        loss, grads = step(params, batch, KEY)
    (warning,) = caught  # one warning, at the first call
    text = str(warning.message)
    assert f"{os.path.basename(__file__)}:{found.line}: padding_unstable" in text
    assert f"fix: {found.fix}" in text and "unsplit.linen.dot_product_attention" in text
    assert (warning.filename, warning.lineno) == (__file__, found.line)
    plain = unsplit.value_and_grad(loss_fn)(params, batch, KEY)  # audit=False: the same step
    assert np.isfinite(float(loss))
    for a, b in zip(jax.tree.leaves((loss, grads)), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the step audits once: later calls do not warn
        step(params, batch, KEY)


def test_audit_true_still_refuses_a_schedule_breaking_finding_next_to_a_padding_one():
    attention_loss, params, batch = _attention_problem()
    captured = jax.random.key(42)

    def careless(p, x, key):  # a foreign key: every example gets the same noise
        noise = jax.random.uniform(captured, x.shape)
        return attention_loss(p, x * noise, key)

    step = unsplit.value_and_grad(careless, audit=True)
    with (
        pytest.warns(audit_finding.PaddingWarning),
        pytest.raises(unsplit.AuditError, match=r"foreign_key") as raised,
    ):
        step(params, batch, KEY)
    assert "padding_unstable" not in str(raised.value)


def test_raise_for_warns_once_per_message_with_the_default_filter():
    found = [audit_finding.Finding("padding_unstable", "m", "f", "/x/once.py", 7)]
    audit_finding._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        audit_finding.raise_for(found, {"padding_unstable"})
        audit_finding.raise_for(found, {"padding_unstable"})
    assert len(caught) == 1 and caught[0].category is audit_finding.PaddingWarning
    assert (caught[0].filename, caught[0].lineno) == ("/x/once.py", 7)
    audit_finding._WARNED.clear()
