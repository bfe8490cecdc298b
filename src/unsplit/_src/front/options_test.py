"""Options: one home, validated once; ``bitwise=`` in its three spellings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import unsplit
from unsplit._src.front.options import Bitwise, Options


def loss_fn(w, x, key):
    keep = jax.random.bernoulli(key, 0.9, x.shape)
    return jnp.sum((jnp.where(keep, x / 0.9, 0.0) @ w) ** 2)


W, X, KEY = jnp.ones((3, 2)), jnp.arange(48.0).reshape(16, 3) / 48, jax.random.key(0)


def test_bitwise_spellings_are_one_options_object():
    assert Options.make(bitwise=True, chunk_size=8).bitwise == Bitwise(chunk_size=8)
    assert Options.make(bitwise=Bitwise(chunk_size=8)).bitwise == Bitwise(chunk_size=8)
    assert Options.make(bitwise=True).bitwise == Bitwise()
    assert Options.make(bitwise=False).bitwise is None
    assert Bitwise(chunk_axes=["fsdp"]).chunk_axes == ("fsdp",)


def test_bitwise_object_and_keywords_give_the_same_bits():
    a = unsplit.value_and_grad(loss_fn, bitwise=True, chunk_size=8)(W, X, KEY)
    b = unsplit.value_and_grad(loss_fn, bitwise=unsplit.Bitwise(chunk_size=8))(W, X, KEY)
    assert unsplit.testing.bits_equal(a, b)
    step = unsplit.value_and_grad(loss_fn, bitwise=unsplit.Bitwise(chunk_size=8))
    assert step.bitwise is True and step.chunk_size == 8
    assert "bitwise=Bitwise(chunk_size=8, chunk_axes=None, blocks=8)" in repr(step)


def test_both_spellings_at_once_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"already holds.*chunk_size=4.*Fix: pass them inside"):
        unsplit.value_and_grad(loss_fn, bitwise=unsplit.Bitwise(chunk_size=8), chunk_size=4)


@pytest.mark.parametrize("name", ["chunk_size", "chunk_axes"])
def test_bitwise_options_without_bitwise_mode_are_refused(name):
    value = 4 if name == "chunk_size" else "data"
    with pytest.raises(ValueError, match=rf"{name}=.* only applies with bitwise=True.*Fix"):
        unsplit.value_and_grad(loss_fn, **{name: value})


@pytest.mark.parametrize("name", ["microbatches", "group_size", "chunk_size"])
@pytest.mark.parametrize(
    ("value", "error"), [(2.0, TypeError), ("2", TypeError), (True, TypeError), (0, ValueError)]
)
def test_counts_share_one_check(name, value, error):
    kwargs = {name: value, **({"bitwise": True} if name == "chunk_size" else {})}
    with pytest.raises(error, match=rf"{name} must be .*got {name}=.*Fix"):
        unsplit.value_and_grad(loss_fn, **kwargs)


def test_bitwise_object_validates_itself():
    with pytest.raises(TypeError, match=r"chunk_axes must be a mesh axis name"):
        Bitwise(chunk_axes=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"chunk_size must be >= 1"):
        Bitwise(chunk_size=0)


def test_options_are_frozen_and_a_step_reads_them():
    step = unsplit.value_and_grad(loss_fn, microbatches=4, weighted=False)
    with pytest.raises(AttributeError):
        step.options.microbatches = 2  # type: ignore[misc]
    assert step.microbatches == 4 and step.options.mode == "default"
    np.testing.assert_allclose(step(W, X, KEY)[0], unsplit.value_and_grad(loss_fn)(W, X, KEY)[0])
