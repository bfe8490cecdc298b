"""Tests for the rule: example keys are fold_in(key, id), 64-bit ids, refusals."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import unsplit
from unsplit._src import keys as keys_lib

KEY = jax.random.key(1234)


def key_bits(keys):
    return np.asarray(jax.random.key_data(keys))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint32, jnp.int16, jnp.uint8])
def test_equals_fold_in_below_2_32(dtype):
    top = np.iinfo(np.dtype(dtype)).max
    ids = np.array([0, 1, 2, 7, 100, top], dtype=np.dtype(dtype))
    got = key_bits(unsplit.example_keys(KEY, jnp.asarray(ids)))
    want = np.stack([key_bits(jax.random.fold_in(KEY, int(i))) for i in ids])
    np.testing.assert_array_equal(got, want)


def test_equals_fold_in_for_largest_uint32_id():
    ids = np.array([2**32 - 1, 2**31, 2**31 - 1], dtype=np.uint32)
    got = key_bits(unsplit.example_keys(KEY, ids))
    want = np.stack([key_bits(jax.random.fold_in(KEY, jnp.uint32(i))) for i in ids])
    np.testing.assert_array_equal(got, want)


def test_any_ids_shape():
    ids = jnp.arange(24).reshape(2, 3, 4)
    keys = unsplit.example_keys(KEY, ids)
    assert keys.shape == (2, 3, 4)
    np.testing.assert_array_equal(key_bits(keys[1, 2, 3]), key_bits(jax.random.fold_in(KEY, 23)))
    assert unsplit.example_keys(KEY, jnp.zeros((0,), jnp.int32)).shape == (0,)
    assert unsplit.example_keys(KEY, 5).shape == ()


def test_golden_bits_pinned():
    # If a JAX upgrade changes threefry or fold_in, every user's noise changes: fail loudly.
    got = key_bits(unsplit.example_keys(jax.random.key(0), jnp.array([0, 1, 2**20])))
    want = np.array(
        [[1797259609, 2579123966], [928981903, 3453687069], [2652788359, 1597282999]],
        dtype=np.uint32,
    )
    np.testing.assert_array_equal(got, want)
    wide = key_bits(unsplit.example_keys(jax.random.key(0), unsplit.ids64([2**40 + 3])))
    np.testing.assert_array_equal(wide, np.array([[2684835162, 807106035]], dtype=np.uint32))


def test_64_bit_ids_from_numpy_without_x64():
    assert not jax.config.jax_enable_x64
    ids = np.array([5, 2**32 + 5, 2**40 + 5, 2**63 - 1], dtype=np.int64)
    keys = key_bits(unsplit.example_keys(KEY, ids))
    assert len({tuple(k) for k in keys}) == 4  # the high word is not dropped
    np.testing.assert_array_equal(keys[0], key_bits(jax.random.fold_in(KEY, 5)))
    np.testing.assert_array_equal(keys, key_bits(unsplit.example_keys(KEY, unsplit.ids64(ids))))


def test_64_bit_ids_distinct_on_a_dense_grid():
    # Ids that share the low word but differ in the high word, and vice versa.
    lo = np.arange(256, dtype=np.uint64)
    hi = np.arange(256, dtype=np.uint64) << np.uint64(32)
    ids = (lo[:, None] + hi[None, :]).reshape(-1)
    keys = key_bits(unsplit.example_keys(KEY, ids))
    assert len({tuple(k) for k in keys}) == ids.size


def test_ids64_inside_jit():
    ids = unsplit.ids64(np.array([1, 2**35], dtype=np.int64))
    jitted = jax.jit(unsplit.example_keys)
    np.testing.assert_array_equal(
        key_bits(jitted(KEY, ids)), key_bits(unsplit.example_keys(KEY, ids))
    )
    np.testing.assert_array_equal(
        key_bits(jitted(KEY, ids)[0]), key_bits(jax.random.fold_in(KEY, 1))
    )


def test_traced_int_ids_inside_jit_and_vmap():
    ids = jnp.arange(6)
    got = key_bits(jax.jit(unsplit.example_keys)(KEY, ids))
    want = key_bits(jax.vmap(lambda i: jax.random.fold_in(KEY, i))(ids))
    np.testing.assert_array_equal(got, want)


def test_legacy_raw_key_gives_raw_keys():
    raw = jax.random.PRNGKey(7)
    keys = unsplit.example_keys(raw, jnp.arange(3))
    assert keys.shape == (3, 2) and keys.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(keys[2]), np.asarray(jax.random.fold_in(raw, 2)))


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_refuses_rbg_keys(impl):
    with pytest.raises(TypeError, match=r"rbg.*not give the same bits under vmap.*jax.random.key"):
        unsplit.example_keys(jax.random.key(0, impl=impl), jnp.arange(2))


@pytest.mark.parametrize(
    "bad",
    [3, np.float32(1.0), jnp.zeros((2,), jnp.float32), jnp.zeros((3,), jnp.uint32)],
    ids=["int", "float", "float-array", "uint32x3"],
)
def test_refuses_non_keys(bad):
    with pytest.raises(TypeError, match=r"must be a PRNG key made by jax.random.key"):
        unsplit.example_keys(bad, jnp.arange(2))


def test_refuses_key_arrays():
    with pytest.raises(
        ValueError, match=r"single key of shape \(\); got a key array of shape \(2,\)"
    ):
        unsplit.example_keys(jax.random.split(KEY, 2), jnp.arange(2))


@pytest.mark.parametrize(
    "ids", [jnp.array([0.0, 1.0]), np.array([0.5]), jnp.array([True, False])], ids=str
)
def test_refuses_non_integer_ids(ids):
    with pytest.raises(TypeError, match=r"ids must be an integer array.*got dtype="):
        unsplit.example_keys(KEY, ids)


@pytest.mark.parametrize("ids", [jnp.array([3, -1]), np.array([-5], np.int64), [-1]], ids=str)
def test_refuses_negative_ids(ids):
    with pytest.raises(ValueError, match=r"non-negative.*got min\(ids\)=-"):
        unsplit.example_keys(KEY, ids)


def test_refuses_ids_above_2_63():
    with pytest.raises(ValueError, match=r"at most 2\*\*63 - 1"):
        unsplit.example_keys(KEY, np.array([2**63], dtype=np.uint64))
    with pytest.raises(TypeError, match=r"do not fit 64 bits"):
        unsplit.ids64([2**70])


# ---- 64-bit ids: words must be integers, and ids >= 2**31 survive a user's jit ----------


@pytest.mark.parametrize(
    ("hi", "lo", "error", "message"),
    [
        (np.zeros(2, np.float32), np.zeros(2, np.uint32), TypeError,
         r"Ids64.hi must hold integer words \(uint32\); got dtype=float32.*truncated"),
        (np.zeros(2, np.uint32), jnp.ones(2), TypeError, r"Ids64.lo must hold integer words"),
        (np.zeros(2, np.uint32), np.zeros(3, np.uint32), ValueError,
         r"same shape.*got hi.shape=\(2,\) and lo.shape=\(3,\)"),
        (np.array([2**31]), np.zeros(1, np.uint32), ValueError,
         r"Ids64.hi words must lie in \[0, 2147483647\]; got min=2147483648"),
        (np.zeros(1, np.int64), np.array([2**32]), ValueError,
         r"Ids64.lo words must lie in \[0, 4294967295\]"),
    ],
)  # fmt: skip
def test_ids64_refuses_float_words_bad_ranges_and_mismatched_shapes(hi, lo, error, message):
    with pytest.raises(error, match=message):
        unsplit.Ids64(hi=hi, lo=lo)


def test_64_bit_ids_pass_through_a_users_jit_exactly():
    key = jax.random.key(0)
    records = np.arange(4, dtype=np.int64) + 2**33
    expected = unsplit.example_keys(key, records)  # outside jit: split exactly on the host

    @jax.jit
    def user_step(key, ids):
        return unsplit.example_keys(key, ids)

    exact = user_step(key, unsplit.ids64(records))
    assert (jax.random.key_data(exact) == jax.random.key_data(expected)).all()
    # The hazard the docs warn about: JAX turns an int64 NumPy argument into int32 when
    # x64 is off, so ids 2**33 + i become i. If this starts failing, JAX changed that.
    truncated = user_step(key, records)
    small = unsplit.example_keys(key, np.arange(4))
    assert (jax.random.key_data(truncated) == jax.random.key_data(small)).all()
    # global_batch gives the two-word form for 64-bit ids, whatever their values, so every
    # process returns the same kind of ids.
    mesh = jax.make_mesh((4,), ("data",))
    _, ids = unsplit.global_batch({"x": np.ones((4, 1))}, mesh, local_ids=np.arange(4))
    assert isinstance(ids, unsplit.Ids64)
    _, ids = unsplit.global_batch(
        {"x": np.ones((4, 1))}, mesh, local_ids=np.arange(4, dtype=np.uint32)
    )
    assert not isinstance(ids, unsplit.Ids64)


def test_truncated_ids_that_turned_negative_are_refused_with_the_cause():
    truncated = jnp.asarray(np.array([1, 2**31 + 5], np.int64))  # int32 -2147483643
    with pytest.raises(ValueError, match=r"int64 ids >= 2\*\*31 that JAX truncated.*ids64"):
        unsplit.example_keys(jax.random.key(0), truncated)


# -- step= : the step number folded into the key (issue 40, item 6) ----------------------


@pytest.mark.parametrize("step", [0, 7, 2**31, 2**32 - 1, np.int64(3), np.uint32(9)])
def test_step_key_is_the_hosts_fold_in(step):
    key = jax.random.key(0)
    number = keys_lib.step_number(step)
    assert isinstance(number, np.uint32)  # one type for every step: nothing traced again
    folded = jax.jit(keys_lib.step_key)(key, number)
    assert (jax.random.key_data(folded) == jax.random.key_data(jax.random.fold_in(key, step))).all()


def test_step_number_keeps_an_integer_array_such_as_a_train_states_step():
    count = jnp.int32(5)
    assert keys_lib.step_number(count) is count
    assert keys_lib.step_number(None) is None
    assert keys_lib.step_key(jax.random.key(0), None).shape == ()


@pytest.mark.parametrize(
    ("step", "error", "message"),
    [
        (-1, ValueError, "step must be a step number in [0, 2**32)"),
        (2**32, ValueError, "got step=4294967296"),
        (1.5, TypeError, "step must be an integer of shape ()"),
        (True, TypeError, "got step=True"),
        (jnp.zeros(2, jnp.int32), TypeError, "Fix: pass the loop's counter"),
        (jnp.float32(1), TypeError, "integer of shape ()"),
    ],
)
def test_step_number_refuses_what_is_no_step_number(step, error, message):
    with pytest.raises(error, match=re.escape(message)):
        keys_lib.step_number(step)
