import jax.numpy as jnp
import numpy as np

from unsplit._src.trees import bits_equal, rel_l2


def test_a_non_contiguous_leaf_is_compared_by_value():
    # what jax.device_get returns on a TPU can be a strided view; .view(uint8) refuses one
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert not x.T.flags.c_contiguous
    assert bits_equal({"w": x.T}, {"w": np.ascontiguousarray(x.T)})
    assert bits_equal(x[:, ::2], x.copy()[:, ::2])
    changed = x.copy()
    changed[0, 2] = np.nextafter(changed[0, 2], np.float32(np.inf))
    assert not bits_equal(x[:, ::2], changed[:, ::2])


def test_bits_not_numbers_decide():
    assert not bits_equal(np.float32(0.0), np.float32(-0.0))
    nan = np.array([np.nan], np.float32)
    assert bits_equal(nan, nan.copy())


def test_structure_dtype_and_shape_must_match():
    x = np.zeros((2, 3), np.float32)
    assert not bits_equal({"a": x}, {"b": x})
    assert not bits_equal(x, x.astype(np.float64))
    assert not bits_equal(x, x.reshape(3, 2))
    assert not bits_equal(x, x.reshape(6))
    assert bits_equal((jnp.asarray(x), 1), (x, 1))


def test_rel_l2_is_relative():
    assert rel_l2({"a": np.ones(4)}, {"a": np.ones(4)}) == 0.0
    assert np.isclose(rel_l2(np.array([1.1, 0.0]), np.array([1.0, 0.0])), 0.1)
