"""batched.py: mean_of_means in loops, device keys vs global positions, and batch_draw naming
every line that draws from the same key."""

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import unsplit

KEY = jax.random.key(0)
W = jnp.ones(4)


def test_mean_of_means_in_a_while_loop():
    def step(w, batch):
        def body(carry):
            i, total = carry
            micro = jax.lax.dynamic_slice_in_dim(batch["mask"], i * 4, 4)
            return i + 1, total + jnp.sum(micro * w[0]) / jnp.sum(micro)

        n = batch["mask"].shape[0] // 4
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, jnp.zeros(())))[1]

    batch = {"mask": jnp.ones((16,))}
    (finding,) = unsplit.audit_step(step, W, batch)
    assert finding.kind == "mean_of_means"


def test_a_mean_of_equal_microbatches_by_a_constant_is_not_reported():
    def step(w, batch):
        def body(total, micro):
            return total + jnp.mean(micro["x"] @ w), None

        micro = batch["x"].reshape(4, -1, 4)
        return jax.lax.scan(body, 0.0, {"x": micro})[0] / 4

    assert unsplit.audit_step(step, W, {"x": jnp.ones((16, 4))}) == []


def test_a_global_position_from_axis_index_is_not_a_device_key():
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def step(w, x, key):
        def shard(w, x, key):
            ids = jax.lax.axis_index("d") * x.shape[0] + jnp.arange(x.shape[0])
            keys = unsplit.example_keys(key, ids)
            y = jax.vmap(lambda k, e: unsplit.dropout(k, e, 0.1))(keys, x)
            return jax.lax.psum(jnp.sum(y @ w), "d")

        specs = (jax.P(), jax.P("d"), jax.P())
        return jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=jax.P())(w, x, key)

    assert unsplit.audit_step(step, W, jnp.ones((8, 4)), KEY) == []


def test_batch_draw_names_every_line_that_draws_from_the_same_key():
    first = inspect.currentframe().f_lineno + 4

    def step(w, x, key):  # six batch-level dropouts from one key, one per line
        h = x @ jnp.ones((4, 4))
        h = jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h, 0.0)
        h = jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h, 0.0)
        h = jnp.where(jax.random.bernoulli(key, 0.7, h.shape), h, 0.0)
        h = jnp.where(jax.random.bernoulli(key, 0.6, h.shape), h, 0.0)
        h = jnp.where(jax.random.bernoulli(key, 0.5, h.shape), h, 0.0)
        h = jnp.where(jax.random.bernoulli(key, 0.4, h.shape), h, 0.0)
        return jnp.sum(h @ w)

    (finding,) = unsplit.audit_step(step, W, jnp.ones((8, 4)), KEY)
    assert (finding.kind, finding.file, finding.line) == ("batch_draw", __file__, first)
    name = __file__.rsplit("/", 1)[-1]
    others = [f"{name}:{first + i}" for i in range(1, 6)]
    assert f"The same key also draws at 5 other lines: {', '.join(others)}." in finding.message


# ---- one key per microbatch: the loop runs once per microbatch, one key draws for it all ----

MICRO = 4  # fixed microbatch size: a larger batch means more microbatches, not larger ones


def _mb_loss(w, x, mask):
    return jnp.mean((jnp.where(mask, x, 0.0) @ w) ** 2)


def levanter_style(w, batch, key):
    k = batch.shape[0] // MICRO
    keys = jax.random.split(key, k)

    def body(acc, xs):
        x, kk = xs
        mask = jax.random.bernoulli(kk, 0.9, x.shape)  # LEVANTER_DRAW
        return acc + jax.grad(_mb_loss)(w, x, mask), None

    g, _ = jax.lax.scan(body, jnp.zeros_like(w), (batch.reshape(k, MICRO, -1), keys))
    return g / k


def fold_in_per_microbatch(w, batch, key):
    k = batch.shape[0] // MICRO
    mbs = batch.reshape(k, MICRO, -1)

    def body(acc, i):
        mask = jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, mbs[i].shape)  # FOLD_DRAW
        return acc + jax.grad(_mb_loss)(w, mbs[i], mask), None

    g, _ = jax.lax.scan(body, jnp.zeros_like(w), jnp.arange(k))
    return g / k


def per_example_keys_per_microbatch(w, batch, key):
    k = batch.shape[0] // MICRO
    keys = unsplit.example_keys(key, jnp.arange(batch.shape[0])).reshape(k, MICRO)

    def body(acc, xs):
        x, kk = xs
        mask = jax.vmap(lambda kk, row: jax.random.bernoulli(kk, 0.9, row.shape))(kk, x)
        return acc + jax.grad(_mb_loss)(w, x, mask), None

    g, _ = jax.lax.scan(body, jnp.zeros_like(w), (batch.reshape(k, MICRO, -1), keys))
    return g / k


@pytest.mark.parametrize(
    ("fn", "marker"), [(levanter_style, "LEVANTER_DRAW"), (fold_in_per_microbatch, "FOLD_DRAW")]
)
def test_one_key_per_microbatch_is_a_batch_draw_at_its_line(fn, marker):
    args = (jnp.ones((3, 2)), jnp.ones((16, 3)), jax.random.key(0))
    (found,) = [f for f in unsplit.audit_step(fn, *args) if f.kind == "batch_draw"]
    source = inspect.getsource(fn).splitlines()
    offset = next(i for i, line in enumerate(source) if marker in line)
    assert found.line == fn.__code__.co_firstlineno + offset
    assert "once per microbatch" in found.message and "example_keys" in found.message


def test_per_example_keys_inside_a_microbatch_loop_pass():
    args = (jnp.ones((3, 2)), jnp.ones((16, 3)), jax.random.key(0))
    assert not unsplit.audit_step(per_example_keys_per_microbatch, *args)


# ---- the steps people run: shard_map over Explicit and Auto meshes, pmap ----


def _noisy_shard(w, x, key):
    keep = jax.random.bernoulli(key, 0.9, x.shape)  # SHARD_DRAW
    dev = jax.random.fold_in(key, jax.lax.axis_index("d"))  # SHARD_DEVICE
    noise = jax.random.normal(dev, w.shape)
    return jax.lax.psum(jnp.sum(jnp.where(keep, x, 0.0) @ (w + noise)), "d")


def _line(fn, marker):
    source = inspect.getsource(fn).splitlines()
    return fn.__code__.co_firstlineno + next(i for i, t in enumerate(source) if marker in t)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("mesh_arg", [True, False])
def test_shard_map_steps_are_audited_over_explicit_and_auto_meshes(axis_type, mesh_arg):
    axis_types = (getattr(jax.sharding.AxisType, axis_type),)
    mesh = jax.make_mesh((2,), ("d",), axis_types=axis_types, devices=jax.devices()[:2])
    specs = {"in_specs": (jax.P(), jax.P("d"), jax.P()), "out_specs": jax.P()}
    # Without mesh=, shard_map takes the context mesh: the audit traces under the inputs' mesh.
    mapped = jax.shard_map(_noisy_shard, mesh=mesh, **specs) if mesh_arg else None
    mapped = mapped or jax.shard_map(_noisy_shard, **specs)
    x = jax.device_put(jnp.ones((8, 3)), jax.NamedSharding(mesh, jax.P("d")))
    found = unsplit.audit_step(jax.jit(mapped), jnp.ones((3, 2)), x, KEY)
    assert [(f.kind, f.line) for f in found] == [
        ("device_key", _line(_noisy_shard, "SHARD_DEVICE")),
        ("batch_draw", _line(_noisy_shard, "SHARD_DRAW")),
    ]


def _pmapped_loss(w, x, key):
    keep = jax.random.bernoulli(key, 0.9, x.shape)  # PMAP_DRAW
    return jax.lax.pmean(jnp.sum(jnp.where(keep, x, 0.0) @ w), "i")


def _pmap(fn, in_axes):
    with warnings.catch_warnings():  # newer JAX deprecates jax.pmap: its users are audited
        warnings.simplefilter("ignore", DeprecationWarning)
        return jax.pmap(fn, axis_name="i", in_axes=in_axes)


def test_a_pmapped_step_is_checked_per_device_and_names_its_lines():
    # Keys split per device and passed in: the pmap is the step itself, so it has no user line;
    # the finding is at the line that draws from the device's key.
    step = _pmap(_pmapped_loss, (None, 0, 0))
    keys = jax.random.split(KEY, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        found = unsplit.audit_step(step, jnp.ones((3, 2)), jnp.ones((2, 4, 3)), keys)
    line = _line(_pmapped_loss, "PMAP_DRAW")
    assert [(f.kind, f.file, f.line) for f in found] == [
        ("device_key", __file__, line),
        ("batch_draw", __file__, line),  # the batch doubled per device: (2, 8, 3), not (4, 4, 3)
    ]


def test_a_pmapped_step_with_per_example_keys_passes():
    def loss(w, x, keys):
        keep = jax.vmap(lambda k, row: jax.random.bernoulli(k, 0.9, row.shape))(keys, x)
        return jax.lax.pmean(jnp.sum(jnp.where(keep, x, 0.0) @ w), "i")

    keys = unsplit.example_keys(KEY, jnp.arange(8, dtype=jnp.uint32)).reshape(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        step = _pmap(loss, (None, 0, 0))
        assert unsplit.audit_step(step, jnp.ones((3, 2)), jnp.ones((2, 4, 3)), keys) == []


# ---- issue 40: a diffusers-style pmap script, microbatches stacked for accumulation ----


def _diffusion_step():
    """A ``jax.pmap(train_step, "batch")`` shaped like the diffusers Flax text-to-image
    script: noise, timesteps and the UNet's dropout from keys split per step."""
    import flax.linen as nn
    import optax
    from flax.training import train_state

    class Unet(nn.Module):
        @nn.compact
        def __call__(self, x, t, text):
            h = nn.Dense(16)(x) + nn.Dense(16)(text) + t[:, None] / 1000
            return nn.Dense(x.shape[-1])(nn.Dropout(0.1, deterministic=False)(h))  # UNET_DROP

    unet, encoder = Unet(), nn.Dense(8)

    def train_step(state, text_encoder_params, batch, train_rng):
        dropout_rng, sample_rng, new_train_rng = jax.random.split(train_rng, 3)

        def compute_loss(params):
            latents = batch["pixel_values"]
            noise_rng, timestep_rng = jax.random.split(sample_rng)
            noise = jax.random.normal(noise_rng, latents.shape)  # NOISE_DRAW
            steps = jax.random.randint(timestep_rng, (latents.shape[0],), 0, 1000)  # T_DRAW
            noisy = latents + noise * steps[:, None] / 1000
            text = encoder.apply({"params": text_encoder_params}, batch["input_ids"])
            pred = unet.apply({"params": params}, noisy, steps, text, rngs={"dropout": dropout_rng})
            return jnp.mean((pred - noise) ** 2)

        loss, grad = jax.value_and_grad(compute_loss)(state.params)
        new_state = state.apply_gradients(grads=jax.lax.pmean(grad, "batch"))
        return new_state, jax.lax.pmean({"loss": loss}, "batch"), new_train_rng

    params = unet.init(KEY, jnp.ones((1, 4)), jnp.ones((1,)), jnp.ones((1, 8)))["params"]
    text_params = encoder.init(KEY, jnp.ones((1, 3)))["params"]
    state = train_state.TrainState.create(apply_fn=unet.apply, params=params, tx=optax.sgd(0.1))
    return train_step, state, text_params


@pytest.mark.usefixtures("standard_promotion")  # the script's own code mixes int and float
def test_a_diffusers_style_pmap_script_names_its_lines():
    from flax import jax_utils

    train_step, state, text_params = _diffusion_step()
    n = jax.local_device_count()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        p_train_step = jax.pmap(train_step, "batch", donate_argnums=(0,))
        # As the script places them: replicated by flax (a mesh of axis '_device_put_sharded')
        # and the batch sharded over the same axis, one key per device.
        mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("_device_put_sharded",))
        batch = {"pixel_values": jnp.ones((n, 2, 4)), "input_ids": jnp.ones((n, 2, 3))}
        batch = jax.device_put(batch, jax.NamedSharding(mesh, jax.P("_device_put_sharded")))
        args = (jax_utils.replicate(state), jax_utils.replicate(text_params), batch)
        found = unsplit.audit_step(p_train_step, *args, jax.random.split(KEY, n))
    noise = _line(train_step, "NOISE_DRAW")
    assert [(f.kind, f.file, f.line) for f in found] == [
        ("device_key", __file__, noise),
        ("batch_draw", __file__, noise),
    ]
    also = f"{__file__.rsplit('/', 1)[-1]}:{_line(train_step, 'T_DRAW')}"
    assert all(also in f.message for f in found)
    assert "batch_batched_test" not in found[1].message  # the script's own lines, no internals
    assert f":{_unet_drop_line()}" in found[1].message  # the UNet's dropout, same key


def _unet_drop_line():
    source = inspect.getsource(_diffusion_step).splitlines()
    offset = next(i for i, t in enumerate(source) if "UNET_DROP" in t)
    return _diffusion_step.__code__.co_firstlineno + offset


ACCUMULATION = 4


def _stacked_accumulation(model):
    """Gradient accumulation as Flax trainers write it: the batch stacked ``(K, mb, ...)``,
    a Python loop of ``K`` steps, a key split per microbatch for its dropout."""

    @jax.jit
    def train_step(params, batch, key):
        keys = jax.random.split(key, ACCUMULATION)
        grads = jax.tree.map(jnp.zeros_like, params)
        for i in range(ACCUMULATION):
            micro = jax.tree.map(lambda x, i=i: x[i], batch)

            def loss(p, micro=micro, i=i):
                pred = model.apply({"params": p}, micro["x"], rngs={"dropout": keys[i]})  # APPLY
                return jnp.mean((pred[:, 0] - micro["y"]) ** 2)

            grads = jax.tree.map(jnp.add, grads, jax.grad(loss)(params))
        return jax.tree.map(lambda g: g / ACCUMULATION, grads)

    return train_step


def test_microbatches_stacked_for_accumulation_are_a_batch_draw_at_dropout_and_apply():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(16)(x))
            return nn.Dense(1)(nn.Dropout(0.1, deterministic=False)(h))  # MLP_DROP

    model = MLP()
    params = model.init(KEY, jnp.ones((1, 8)))["params"]
    batch = {"x": jnp.ones((ACCUMULATION, 8, 8)), "y": jnp.ones((ACCUMULATION, 8))}
    step = _stacked_accumulation(model)
    (found,) = unsplit.audit_step(step, params, batch, KEY)
    assert found.kind == "batch_draw"
    here = test_microbatches_stacked_for_accumulation_are_a_batch_draw_at_dropout_and_apply
    assert (found.file, found.line) == (__file__, _line(here, "MLP_DROP"))
    apply = f"{__file__.rsplit('/', 1)[-1]}:{_line(_stacked_accumulation, 'APPLY')}"
    assert apply in found.message, found.message
    assert f"holds {ACCUMULATION} microbatches stacked" in found.message


def test_one_key_drawing_noise_shared_by_every_example_is_no_stacked_batch_draw():
    def step(w, batch, key):
        noise = jax.random.normal(key, batch["x"].shape[1:])  # the same for every example
        return jnp.sum((batch["x"] + noise[None]) @ w)

    assert unsplit.audit_step(step, jnp.ones((8, 2)), {"x": jnp.ones((4, 6, 8))}, KEY) == []
