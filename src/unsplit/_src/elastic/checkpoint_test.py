"""Checkpointer: restore onto another mesh, settings checked, unfinished saves ignored."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit

SETTINGS = {"seed": 0, "global_batch": 64, "chunk_size": 8}


def state_on(mesh, spec=None):
    spec = P() if spec is None else spec
    params = {"w": jnp.arange(16.0).reshape(8, 2), "b": jnp.ones((2,), jnp.bfloat16)}
    opt = (jnp.zeros((), jnp.int32), {"mu": jnp.full((8, 2), 0.5)})
    tree = {"params": params, "opt": opt}
    return jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, spec if x.ndim == 2 else P())), tree
    )


def mesh_of(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def test_restores_onto_another_mesh_and_layout(tmp_path):
    saved = state_on(mesh_of(1))
    with unsplit.checkpoint.Checkpointer(tmp_path, settings=SETTINGS) as ckpt:
        ckpt.save(8, saved, info={"devices": 1})
    like = state_on(mesh_of(4), P("data"))
    with unsplit.checkpoint.Checkpointer(tmp_path, settings=SETTINGS) as ckpt:
        step, restored = ckpt.restore(like=like)
        meta = ckpt.metadata()
    assert step == 8
    assert meta["data"] == {"next_step": 8} and meta["info"] == {"devices": 1}
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    for got, want, target in zip(*map(jax.tree.leaves, (restored, saved, like)), strict=True):
        assert got.sharding == target.sharding and got.dtype == want.dtype
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_restore_to_abstract_targets_and_older_steps(tmp_path):
    mesh = mesh_of(2)
    with unsplit.checkpoint.Checkpointer(tmp_path, settings=SETTINGS, max_to_keep=3) as ckpt:
        for step in (2, 4, 6):
            ckpt.save(step, jax.tree.map(lambda x, s=step: x * s, state_on(mesh)))
        assert ckpt.all_steps() == [2, 4, 6] and ckpt.latest_step() == 6
        like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state_on(mesh)
        )
        step, restored = ckpt.restore(like=like, step=4)
    assert step == 4
    np.testing.assert_array_equal(restored["params"]["w"], 4 * np.arange(16.0).reshape(8, 2))


def test_changed_settings_are_named_with_the_fix(tmp_path):
    state = state_on(mesh_of(1))
    with unsplit.checkpoint.Checkpointer(tmp_path, settings=SETTINGS) as ckpt:
        ckpt.save(3, state)
    changed = {**SETTINGS, "global_batch": 32}
    with pytest.raises(
        unsplit.checkpoint.SettingsMismatch,
        match=r"step 3 .* global_batch: saved 64, this run 32\. .*Fix: resume with "
        r"global_batch=64, or start a new run in an empty directory",
    ):
        unsplit.checkpoint.Checkpointer(tmp_path, settings=changed).restore(like=state)
    extra = {"seed": 1, "global_batch": 64, "jax": "0.10.2"}
    with pytest.raises(
        ValueError,
        match=r"chunk_size: saved 8, this run <absent>; jax: saved <absent>, this run "
        r'"0\.10\.2"; seed: saved 0, this run 1',
    ):
        unsplit.checkpoint.Checkpointer(tmp_path, settings=extra).restore(like=state)


def test_an_unfinished_save_is_ignored_and_removed(tmp_path):
    state = state_on(mesh_of(1))
    with unsplit.checkpoint.Checkpointer(tmp_path, settings=SETTINGS) as ckpt:
        ckpt.save(5, state)
    # What a process killed while orbax writes step 6 leaves behind.
    unfinished = tmp_path / "6.orbax-checkpoint-tmp"
    (unfinished / "state").mkdir(parents=True)
    (unfinished / "state" / "partial").write_bytes(b"\0" * 10)
    with unsplit.checkpoint.Checkpointer(tmp_path, settings=SETTINGS) as ckpt:
        assert ckpt.latest_step() == 5
        step, _ = ckpt.restore(like=state)
    assert step == 5 and not unfinished.exists()


def test_errors(tmp_path):
    state = state_on(mesh_of(1))
    with unsplit.checkpoint.Checkpointer(tmp_path, settings=SETTINGS) as ckpt:
        with pytest.raises(FileNotFoundError, match=r"no complete checkpoint in .*Fix: start"):
            ckpt.restore(like=state)
        ckpt.save(1, state)
        ckpt.wait()
        with pytest.raises(FileNotFoundError, match=r"for step 7 .* there are \[1\]"):
            ckpt.restore(like=state, step=7)
        with pytest.raises(TypeError, match=r"arrays or jax.ShapeDtypeStruct leaves.*got ndarray"):
            ckpt.restore(like=jax.tree.map(np.asarray, state))
        no_sharding = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        with pytest.raises(ValueError, match=r"needs a sharding for every leaf"):
            ckpt.restore(like=no_sharding)
    with pytest.raises(TypeError, match=r"settings must hold JSON values"):
        unsplit.checkpoint.Checkpointer(tmp_path, settings={"x": object()})
    with pytest.raises(TypeError, match=r"settings must be a mapping.*got list"):
        unsplit.checkpoint.Checkpointer(tmp_path, settings=[("seed", 0)])
    assert sorted(os.listdir(tmp_path)) == ["1"]


def test_frozen_inputs_are_checked_on_resume_on_any_layout(tmp_path):
    # The frozen base is not saved (the run loads it as it starts); what it is, is.
    base = {"w": jnp.arange(32.0).reshape(8, 4), "b": jnp.ones((4,))}
    state = state_on(mesh_of(1))
    with unsplit.checkpoint.Checkpointer(tmp_path, settings=SETTINGS) as ckpt:
        ckpt.save(5, state, frozen=jax.device_put(base, NamedSharding(mesh_of(1), P())))
    resharded = {
        "w": jax.device_put(base["w"], NamedSharding(mesh_of(4), P("data"))),
        "b": base["b"],
    }
    with unsplit.checkpoint.Checkpointer(tmp_path, settings=SETTINGS) as ckpt:
        assert ckpt.restore(like=state, frozen=resharded)[0] == 5  # the same values: resumes
        other = {**base, "b": base["b"].at[2].set(1.5)}
        with pytest.raises(
            unsplit.checkpoint.SettingsMismatch,
            match=r"the frozen inputs changed\. frozen values of \['b'\]: saved [0-9a-f]{16}, "
            r"this run [0-9a-f]{16}\. .*Fix: load the frozen inputs the run was saved with",
        ):
            ckpt.restore(like=state, frozen=other)
        with pytest.raises(
            unsplit.checkpoint.SettingsMismatch,
            match=r"frozen shapes and dtypes of \['w'\]: saved float32\[8, 4\], this run "
            r"float32\[4, 8\]",
        ):
            ckpt.restore(like=state, frozen={**base, "w": base["w"].T})
        with pytest.raises(
            unsplit.checkpoint.SettingsMismatch,
            match=r"saved with frozen inputs .*got frozen=None\. Fix: restore\(like, frozen=frozen\)",
        ):
            ckpt.restore(like=state)
