"""group_size: rows grouped into examples, ids into group ids, and every split refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import unsplit
from unsplit._src import keys as keys_lib
from unsplit._src.step import groups


def test_rows_become_groups_and_row_ids_group_ids():
    batch = {"x": np.arange(24.0).reshape(8, 3), "y": np.arange(8)}
    grouped, ids = groups.group_rows(batch, np.arange(16, 24), 4, shares=2)
    assert grouped["x"].shape == (2, 4, 3) and grouped["y"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ids.tolist() == [4, 5]
    assert groups.group_rows(batch, None, 4, shares=1)[1] is None


def test_jax_rows_and_ids_are_grouped_on_device():
    batch = jnp.arange(16.0).reshape(8, 2)
    grouped, ids = groups.group_rows(batch, jnp.arange(8, 16), 2, shares=4)
    assert grouped.shape == (4, 2, 2) and ids.tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("group_size", [4, 3, 65536])
def test_64_bit_ids_are_divided_exactly_in_32_bit_words(group_size):
    first = np.array([2**40 + 7 * group_size, 2**63 - group_size, 0], dtype=np.uint64)
    first -= first % np.uint64(group_size)
    rows = (first[:, None] + np.arange(group_size, dtype=np.uint64)).ravel()
    hi, lo = keys_lib.id_words(rows)
    batch = np.zeros((rows.size, 1), np.float32)
    _, ids = groups.group_rows(batch, keys_lib.Ids64(hi=hi, lo=lo), group_size, shares=1)
    got = (np.asarray(ids.hi, np.uint64) << np.uint64(32)) | np.asarray(ids.lo, np.uint64)
    assert got.tolist() == (first // np.uint64(group_size)).tolist()


@pytest.mark.parametrize(
    ("rows", "shares", "match"),
    [
        (10, 1, r"10 rows, not a whole number of groups.*multiple of 4"),
        (16, 8, r"would split a group: 16 rows cut into 8 pieces.*2 rows each.*multiple of 32"),
        (12, 2, r"would split a group: 12 rows cut into 2 pieces.*6 rows each"),
    ],
)
def test_a_split_group_is_refused_with_the_fix(rows, shares, match):
    with pytest.raises(ValueError, match=match):
        groups.group_rows(np.zeros((rows, 2)), None, 4, shares=shares)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 8], r"rows 0-3 have ids \[1, 2, 3, 4\]"),  # not aligned
        ([0, 1, 2, 3, 4, 6, 5, 7], r"rows 4-7 have ids \[4, 6, 5, 7\].*shuffle whole groups"),
    ],
)
def test_ids_that_break_a_group_are_refused(ids, match):
    with pytest.raises(ValueError, match=match):
        groups.group_rows(np.zeros((8, 2)), np.asarray(ids), 4, shares=1)


def test_bad_ids_types_and_shapes():
    with pytest.raises(ValueError, match=r"shape \(B,\) = \(8,\)"):
        groups.group_rows(np.zeros((8, 2)), np.arange(4), 4, shares=1)
    with pytest.raises(TypeError, match="integer"):
        groups.group_rows(np.zeros((8, 2)), np.arange(8.0), 4, shares=1)
    words = keys_lib.Ids64(hi=jnp.zeros(4, jnp.uint32), lo=jnp.arange(4, dtype=jnp.uint32))
    with pytest.raises(ValueError, match=r"shape \(B,\) = \(8,\)"):
        groups.group_rows(np.zeros((8, 2)), words, 4, shares=1)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4"])
def test_bad_group_size(bad):
    with pytest.raises((TypeError, ValueError), match="group_size"):
        unsplit.value_and_grad(lambda p, x, k: jnp.sum(p * x), group_size=bad)


def test_the_step_gets_groups_and_each_group_its_key():
    seen = {}

    def loss_fn(w, group, key):  # ONE group of 2 rows
        seen["shape"] = group.shape
        return jnp.sum(group @ w) * jax.random.uniform(key)

    w, rows, key = jnp.ones(3), jnp.arange(24.0).reshape(8, 3), jax.random.key(1)
    step = unsplit.value_and_grad(loss_fn, group_size=2, microbatches=2)
    loss, grads = step(w, rows, key)
    assert seen["shape"] == (2, 3)
    keys = unsplit.example_keys(key, jnp.arange(4))

    def reference(w):
        return jnp.mean(jax.vmap(loss_fn, (None, 0, 0))(w, rows.reshape(4, 2, 3), keys))

    ref, ref_grads = jax.value_and_grad(reference)(w)
    assert jnp.allclose(loss, ref) and jnp.allclose(grads, ref_grads)
    assert "group_size=2" in repr(step)
