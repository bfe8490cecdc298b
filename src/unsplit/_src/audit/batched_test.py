"""batched.py: mean_of_means in loops, device keys vs global positions, and batch_draw naming
every line that draws from the same key."""

import inspect

import jax
import jax.numpy as jnp

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
