"""FSDP groups add their devices' sums in unsplit's fixed order (issue 27, item 2).

* The compiled chunk program of an FSDP group has no float reduction across the
  group's devices (no all-reduce, no reduce-scatter: only all-gathers and
  all-to-alls); XLA's path had one (the negative control).
* The order is the canonical tree: a group of ``G`` devices with chunks of ``C``
  rows gives exactly the bits of one-device groups with chunks of ``C / G`` (each
  device's rows are one small chunk, added in the same tree).
* Leaves of every kind travel: sharded over the group on either dimension,
  whole over it, integer leaves, frozen inputs, the aux.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import frozen as frozen_lib
from unsplit._src import test_util as testing
from unsplit._src.bitwise import cache
from unsplit._src.bitwise.fsdp import group_reduce

pytestmark = pytest.mark.xdist_group("bitwise")
KEY = jax.random.key(5)


def mesh_of(data: int, fsdp: int) -> Mesh:
    devices = np.array(jax.devices()[: data * fsdp]).reshape(data, fsdp)
    return Mesh(devices, ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)


def loss_fn(params, example, key, frozen):
    h = jnp.tanh(example["x"] @ params["w1"] + params["b"]) * frozen["scale"]
    keep = jax.random.bernoulli(key, 0.8, h.shape)
    h = jnp.where(keep, h / 0.8, 0.0)
    out = h @ params["w2"]
    loss = jnp.sum((out - example["y"]) ** 2) * params["step"].astype(jnp.float32)
    return (loss, example["w"]), {"out": out}


def inputs(mesh: Mesh):
    rng = np.random.default_rng(0)
    raw = {
        "w1": rng.normal(size=(16, 24)).astype(np.float32) / 4,  # sharded on dim 0
        "b": rng.normal(size=(24,)).astype(np.float32),  # whole over the group
        "w2": rng.normal(size=(24, 8)).astype(np.float32) / 4,  # sharded on dim 1
        "step": np.int32(3),  # no gradient
    }
    specs = {"w1": P("fsdp"), "b": P(), "w2": P(None, "fsdp"), "step": P()}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in raw.items()}
    frozen = {"scale": jax.device_put(np.float32(1.5), NamedSharding(mesh, P()))}
    batch = {
        "x": rng.normal(size=(32, 16)).astype(np.float32),
        "y": rng.normal(size=(32, 8)).astype(np.float32),
        "w": rng.uniform(0.5, 1.5, size=(32,)).astype(np.float32),
    }
    return params, frozen, batch


def step_of(mesh: Mesh, chunk_axes, chunk_size: int):
    return unsplit.value_and_grad(
        loss_fn, weighted=True, has_aux=True, mesh=mesh, batch_axes=("data", "fsdp"),
        bitwise=True, chunk_axes=chunk_axes, chunk_size=chunk_size,
    )  # fmt: skip


def run(mesh: Mesh, chunk_axes, chunk_size: int):
    params, frozen, batch = inputs(mesh)
    step = step_of(mesh, chunk_axes, chunk_size)
    return step(params, batch, KEY, frozen=frozen), step, (params, frozen, batch)


def chunk_hlo(step, params, frozen, batch) -> str:
    """The compiled chunk program of the step's first group, as text."""
    engine = step._engine
    grouped, _ = step._group(batch, None)
    state, _ = engine.prepare(frozen_lib.combine(params, frozen), grouped, KEY)
    compiled = state.executables[state.local_groups[0]]
    return compiled.as_text()


def test_the_fixed_sum_walks_the_canonical_tree():
    rows = jnp.arange(5.0)[:, None]
    got = group_reduce.fixed_sum(rows, lambda a, b: jnp.stack([a[0], b[0]]).sum(keepdims=True))
    assert float(got[0]) == 10.0
    order = group_reduce.fixed_sum(np.array(["a", "b", "c", "d", "e"]), lambda a, b: f"({a}+{b})")
    assert order == "(((a+b)+(c+d))+e)"


def test_an_fsdp_groups_chunk_program_has_no_float_reduction_across_its_devices(monkeypatch):
    mesh = mesh_of(2, 4)
    _, step, args = run(mesh, "fsdp", 8)
    text = chunk_hlo(step, *args)
    for kind in ("all-reduce", "reduce-scatter"):
        assert f" {kind}(" not in text and f" {kind}-start(" not in text, kind
    assert " all-to-all(" in text and " all-gather" in text
    # Negative control: XLA's path (the switch off) puts a float reduction there.
    monkeypatch.setattr(group_reduce, "FIXED_ORDER", False)
    _, step, args = run(mesh, "fsdp", 8)
    text = chunk_hlo(step, *args)
    assert " reduce-scatter(" in text or " all-reduce(" in text or " all-reduce-start(" in text
    assert " all-to-all(" not in text


def test_a_groups_params_are_gathered_once_per_step_for_all_of_its_chunks(monkeypatch):
    # 2 groups of 4 devices, 16 rows each: 2 chunks of 8 rows per group, one gather each.
    mesh = mesh_of(2, 4)
    expected, step, (params, frozen, batch) = run(mesh, "fsdp", 8)
    (state,) = step._engine._plans.values()
    assert sorted(state.chunk_params.compiled) == [0, 1] and state.plan.per_group == 2
    # The chunk program takes w1 whole over the group (16 x 24 on each device), gathers none.
    text = chunk_hlo(step, params, frozen, batch)
    assert "f32[16,24]{1,0} parameter(" in text and "f32[4,24]{1,0} parameter(" not in text
    events = []

    def counted(kind, fn):
        def call(*args):
            events.append(kind)
            return fn(*args)

        return call

    for g in (0, 1):
        gather = state.chunk_params.compiled[g]
        monkeypatch.setitem(state.chunk_params.compiled, g, counted(f"gather {g}", gather))
        monkeypatch.setitem(state.executables, g, counted(f"chunk {g}", state.executables[g]))
    again = step(params, batch, KEY, frozen=frozen)
    assert unsplit.testing.bits_equal(again, expected)
    assert events.count("gather 0") == events.count("gather 1") == 1
    assert events.count("chunk 0") == events.count("chunk 1") == 2
    assert events.index("gather 0") < events.index("chunk 0")


def test_a_group_of_g_gives_the_bits_of_one_device_groups_with_chunks_of_c_over_g():
    grouped, _, _ = run(mesh_of(2, 4), "fsdp", 8)  # 4 groups of 4 devices: 2 rows each
    alone, _, _ = run(mesh_of(2, 4), None, 2)  # 8 one-device groups, chunks of 2 rows
    assert unsplit.testing.bits_equal(grouped, alone)
    small, _, _ = run(mesh_of(2, 2), "fsdp", 4)  # groups of 2: 2 rows per device too
    assert unsplit.testing.bits_equal(grouped, small)


def test_groups_of_2_4_and_8_devices_give_the_same_bits_at_one_chunk_size():
    # A chunk of 16 rows is 8 row blocks of 2 rows: 4, 2 or 1 of them per device.
    two, four, eight = (run(mesh_of(1, g), "fsdp", 16)[0] for g in (2, 4, 8))
    assert unsplit.testing.bits_equal(two, four)
    assert unsplit.testing.bits_equal(two, eight)
    alone, _, _ = run(mesh_of(2, 4), None, 2)  # one-device groups with chunks of 2 rows
    assert unsplit.testing.bits_equal(two, alone)


def test_a_group_larger_than_the_row_blocks_warns_that_its_bits_are_its_own():
    with pytest.warns(UserWarning, match=r"FSDP groups of 8 devices .* Fix: chunk_size=16"):
        run(mesh_of(1, 8), "fsdp", 8)


def test_every_kind_of_leaf_travels_and_the_step_is_close_to_default_mode():
    ((loss, aux), grads), _, (params, frozen, batch) = run(mesh_of(2, 4), "fsdp", 8)
    default = unsplit.value_and_grad(
        loss_fn, weighted=True, has_aux=True, mesh=mesh_of(2, 4), batch_axes=("data", "fsdp"),
    )  # fmt: skip
    (loss_d, aux_d), grads_d = default(params, batch, KEY, frozen=frozen)
    np.testing.assert_allclose(loss, loss_d, rtol=1e-5)
    for k in ("w1", "b", "w2"):
        np.testing.assert_allclose(grads[k], grads_d[k], rtol=2e-5, atol=1e-6)
        assert grads[k].sharding.spec == params[k].sharding.spec
    assert grads["step"] is None
    np.testing.assert_allclose(aux["out"], aux_d["out"], rtol=1e-5, atol=1e-6)


def test_a_coupled_steps_programs_have_no_float_reduction_across_an_fsdp_group():
    # batch_loss with chunk_axes: the features, batch loss and pullback programs too.
    mesh = mesh_of(2, 2)

    def place(path, x):
        name = path[-1].key
        spec = P(None, "fsdp") if name == "w1" else P("fsdp", None) if name == "w2" else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    params = jax.tree_util.tree_map_with_path(place, testing.clip_params())
    step = unsplit.value_and_grad(
        lambda *a: testing.clip_features(*a),  # its own programs in the cache
        batch_loss=testing.clip_batch_loss, mesh=mesh, batch_axes=("data", "fsdp"),
        bitwise=True, chunk_size=4, chunk_axes="fsdp",
    )  # fmt: skip
    loss, grads = step(params, testing.clip_batch(), testing.CLIP_KEY)
    testing.clip_close(
        (loss, grads), testing.clip_reference(params, testing.clip_batch(), testing.CLIP_KEY)
    )
    texts = [p.as_text() for p in cache.shared(step._engine.spec).values() if hasattr(p, "as_text")]
    assert len(texts) >= 3  # features, loss, pullback
    for text in texts:
        assert " all-reduce" not in text and " reduce-scatter" not in text


def test_dimensions_split_over_the_chunk_and_a_model_axis_together():
    # One dimension over ("fsdp", "model") or ("model", "fsdp"): each device's block is cut
    # by its coordinates on both (the model one known at run time).
    def run_on(data, bitwise=True):
        devices = np.array(jax.devices()[: data * 4]).reshape(data, 2, 2)
        mesh = Mesh(devices, ("data", "fsdp", "model"), axis_types=(AxisType.Auto,) * 3)
        params, frozen, batch = inputs(mesh_of(1, 1))
        specs = {"w1": P(("fsdp", "model")), "b": P("model"), "w2": P(None, ("model", "fsdp"))}
        params = {
            k: jax.device_put(np.asarray(v), NamedSharding(mesh, specs.get(k, P())))
            for k, v in params.items()
        }
        extra = {"bitwise": True, "chunk_axes": "fsdp", "chunk_size": 8} if bitwise else {}
        step = unsplit.value_and_grad(
            loss_fn, weighted=True, has_aux=True, mesh=mesh, batch_axes=("data", "fsdp"), **extra
        )
        out = step(params, batch, KEY, frozen=jax.device_get(frozen))
        for k in specs:
            assert out[1][k].sharding.spec == params[k].sharding.spec
        return out

    one, two = run_on(1), run_on(2)
    assert unsplit.testing.bits_equal(one, two)
    default = run_on(2, bitwise=False)
    for k in ("w1", "b", "w2"):
        np.testing.assert_allclose(two[1][k], default[1][k], rtol=2e-5, atol=1e-6)
