"""Context parallelism: a mesh axis that shards an example's activations (not the batch or params).

In bitwise mode such an axis belongs to the group: the bits are identical across data
degree, microbatches, processes (by the same placement) and sequence degree (every sum
over the positions is computed in canonical blocks of them);
the dropout mask is a function of the key and position only, so it is the same at every
sequence degree; the activations per device fall with the sequence degree.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
import unsplit.testing

# The bits across model-parallel degrees at XLA's default level, as users compile them.
pytestmark = pytest.mark.usefixtures("users_chunk_level")

S, D = 32, 16
KEY = jax.random.key(3)


def _params():
    rng = np.random.default_rng(0)
    return {k: (rng.normal(size=(D, D)) * 0.3).astype(np.float32) for k in ("q", "k", "v", "o")}


def _batch(n=16):
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(n, S, D)).astype(np.float32)}


def _loss(p, example, key):
    """Attention over one sequence-sharded example, dropout on (per example and position)."""
    x = jax.sharding.reshard(example["x"], P("seq", None))  # [S, D]: positions over "seq"
    q = x @ p["q"]
    # Every position attends to all keys: keys and values gathered over "seq" (ring-free).
    k, v = (jax.sharding.reshard(x @ p[n], P()) for n in ("k", "v"))
    attn = jax.nn.softmax(q @ k.T / np.sqrt(D).astype(np.float32), axis=-1)
    h = jax.sharding.reshard(attn @ v, P("seq", None))
    kept = unsplit.dropout(key, jnp.ones_like(h), 0.25)
    h = jnp.tanh(h * kept @ p["o"])
    return jnp.mean(h**2), kept != 0


def _mesh(data, seq):
    return jax.make_mesh((data, seq), ("data", "seq"), devices=jax.devices()[: data * seq])


def _run(data, seq, microbatches=1, bitwise=True):
    mesh = _mesh(data, seq)
    chunk = {"chunk_size": 4} if bitwise else {}
    step = unsplit.value_and_grad(
        _loss, has_aux=True, mesh=mesh, bitwise=bitwise, microbatches=microbatches, **chunk
    )
    with jax.set_mesh(mesh):
        (loss, mask), grads = step(_params(), _batch(), jax.random.key(3))
    return loss, mask, grads


def test_bits_identical_across_data_degree_and_microbatches_at_a_fixed_seq_degree():
    ref = jax.device_get(_run(1, 2))
    for data, k in ((2, 1), (4, 1), (2, 2)):
        assert unsplit.testing.bits_equal(jax.device_get(_run(data, 2, k)), ref), (data, k)


@pytest.mark.parametrize(("data", "seq"), [(4, 1), (1, 1), (4, 2), (2, 4), (1, 8)])
def test_bits_identical_at_every_seq_degree(data, seq):
    # Degree 8: 4 positions per device, one canonical block each (XLA:CPU computed its tanh
    # in another way alone than fused with the blocks' put-back: canonical_dots).
    # Degree 1 (a seq axis of one device; one device in all) is computed at degree 2.
    assert unsplit.testing.bits_equal(jax.device_get(_run(data, seq)), _reference())


@functools.cache
def _reference():
    return jax.device_get(_run(2, 2))


def test_dropout_mask_is_the_same_at_every_seq_degree_and_mode():
    masks = [np.asarray(_run(2, seq)[1]) for seq in (1, 2, 4)]
    masks.append(np.asarray(_run(2, 2, bitwise=False)[1]))
    assert 0.6 < masks[0].mean() < 0.9  # some dropped, most kept
    for m in masks[1:]:
        np.testing.assert_array_equal(m, masks[0])


def test_close_to_default_mode_and_to_a_plain_jit_step():
    loss, _, grads = _run(2, 2)
    d_loss, _, d_grads = _run(2, 2, bitwise=False)
    plain_loss, plain_grads = _plain(_mesh(2, 2))
    for a, b in ((loss, d_loss), (grads, d_grads), (loss, plain_loss), (grads, plain_grads)):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def _plain(mesh):
    """The same step as a user writes it with jax.jit on the mesh."""
    batch = _batch()
    ids = jnp.arange(batch["x"].shape[0], dtype=jnp.uint32)

    def batched(p, b, k):
        keys = unsplit.example_keys(k, ids)
        keys = jax.sharding.reshard(keys, P("data"))
        losses, _ = jax.vmap(_loss, in_axes=(None, 0, 0))(p, b, keys)
        return jnp.mean(losses)

    with jax.set_mesh(mesh):
        b = jax.device_put(batch, NamedSharding(mesh, P("data")))
        return jax.jit(jax.value_and_grad(batched))(_params(), b, jax.random.key(3))


def test_seq_axis_joins_the_group_and_activation_memory_falls():
    def cost(seq):
        mesh = _mesh(1, seq)
        step = unsplit.value_and_grad(_big_loss, mesh=mesh, bitwise=True, chunk_size=4)
        batch = {"x": np.ones((4, 256, D), np.float32)}
        with jax.set_mesh(mesh):
            return unsplit.testing.bitwise_cost(step, _params(), batch, jax.random.key(0))

    two, four, eight = (cost(s).program_peak_bytes for s in (2, 4, 8))
    # Attention scores are [256, 256] per example: their rows split over "seq" (degree 1 is
    # computed at degree 2, so 2 is the first degree that holds them whole over 2 devices).
    # The chunk program's peak falls about as 1/S: measured 2.36, 1.28, 0.63 MB at 2, 4, 8
    # (JAX 0.10.2), 2.26, 1.34, 0.75 MB (0.12.1, whose buffers hold a little more with the
    # products rounded on their own: 0.68 MB at 8 without). Before the devices' partial sums
    # were exchanged pairwise (moves.pairwise_sum) they were all-gathered, 8 whole partials
    # per device at degree 8: 1.02 MB there.
    assert four < 0.65 * two and eight < 0.6 * four, (two, four, eight)


def _big_loss(p, example, key):
    return _loss(p, example, key)[0]


@pytest.mark.parametrize("spelling", ["named", "bare"])
def test_auto_mesh_with_sharding_constraint_joins_the_group(spelling):
    out = []
    for data in (1, 2):
        mesh = jax.make_mesh(
            (data, 2), ("data", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
            devices=jax.devices()[: 2 * data],
        )  # fmt: skip
        where = P("seq", None) if spelling == "bare" else NamedSharding(mesh, P("seq", None))

        def loss(p, example, key, where=where):
            x = jax.lax.with_sharding_constraint(example["x"], where)
            return jnp.mean(jnp.tanh(x @ p["q"]) ** 2)

        step = unsplit.value_and_grad(loss, mesh=mesh, bitwise=True, chunk_size=4)
        with jax.set_mesh(mesh):
            out.append(jax.device_get(step(_params(), _batch(8), jax.random.key(0))))
    assert unsplit.testing.bits_equal(out[0], out[1])


@pytest.mark.parametrize("kind", ["explicit_reshard", "auto_constraint_naming_fsdp"])
def test_fsdp_groups_with_a_seq_axis_keep_the_losss_annotations(kind):
    """``chunk_axes="fsdp"`` with the loss's annotations over ``seq``: each FSDP group
    (fsdp x seq) computes its devices' rows manual over ``fsdp`` (a spec naming ``fsdp``
    is dropped there), ``seq`` stays XLA's; the bits hold across the data degree."""
    out = []
    for data in (1, 2):
        types = jax.sharding.AxisType.Explicit if kind == "explicit_reshard" else None
        mesh = jax.make_mesh(
            (data, 2, 2), ("data", "fsdp", "seq"), devices=jax.devices()[: 4 * data],
            **({} if types else {"axis_types": (jax.sharding.AxisType.Auto,) * 3}),
        )  # fmt: skip
        where = NamedSharding(mesh, P("seq", "fsdp"))

        def constrained(p, example, key, where=where):
            x = jax.lax.with_sharding_constraint(example["x"], where)
            return jnp.mean(jnp.tanh(x @ p["q"]) ** 2), jnp.zeros(())  # an unbatched aux

        loss = _loss if types else constrained
        params = {
            k: jax.device_put(v, NamedSharding(mesh, P("fsdp"))) for k, v in _params().items()
        }
        step = unsplit.value_and_grad(
            loss, has_aux=True, mesh=mesh, bitwise=True, chunk_size=4,
            batch_axes=("data", "fsdp"), chunk_axes="fsdp",
        )  # fmt: skip
        with jax.set_mesh(mesh):
            out.append(jax.device_get(step(params, _batch(), jax.random.key(3))))
    assert unsplit.testing.bits_equal(out[0], out[1])
    default = _run(2, 2, bitwise=False) if types else None
    if default is not None:
        np.testing.assert_allclose(out[1][0][0], default[0], rtol=1e-5)


@pytest.mark.parametrize(
    ("bitwise", "how"),
    [
        (False, "call"),
        (False, "user jit"),
        (False, "train_step"),
        (True, "call"),
        (True, "train_step"),
    ],
)
def test_grads_keep_the_params_shardings_under_set_mesh(bitwise, how):
    """A position embedding sharded over ``seq`` gets its gradient sharded so, in every
    way the step is called under ``jax.set_mesh`` (the bitwise optimizer update failed
    there: its one-device program under the user's mesh)."""
    mesh = _mesh(2, 4)
    rng = np.random.default_rng(2)
    params = {**_params(), "pos": (rng.normal(size=(S, D)) * 0.1).astype(np.float32)}
    specs = {k: P("seq", None) if k == "pos" else P() for k in params}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}

    def loss(p, example, key):
        return _loss(p, {"x": example["x"] + p["pos"]}, key)[0]

    options = {"chunk_size": 4} if bitwise else {}
    step = unsplit.value_and_grad(loss, mesh=mesh, bitwise=bitwise, **options)
    with jax.set_mesh(mesh):
        if how == "train_step":
            opt = optax.sgd(0.1)
            _, out, _ = unsplit.train_step(step, opt)(params, opt.init(params), _batch(), KEY)
        else:
            run = jax.jit(step) if how == "user jit" else step
            _, out = run(params, _batch(), KEY)
    for k, x in out.items():
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), x.ndim), (k, x.sharding)
