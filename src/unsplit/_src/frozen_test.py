"""Frozen inputs: ``step(params, batch, key, frozen=frozen)``, both modes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import frozen as frozen_lib
from unsplit._src.processes import items

B, D, H, R = 16, 8, 16, 4


def lora_loss(adapter, x, key, base):
    """A frozen base layer, a trained low-rank adapter, dropout on the input."""
    keep = jax.random.bernoulli(key, 0.8, x.shape)
    x = jnp.where(keep, x / 0.8, 0.0)
    h = jnp.tanh(x @ base["w"] + base["b"] + (x @ adapter["a"]) @ adapter["b"])
    return jnp.sum(h**2)


def make(n_base=H, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    base = {
        "w": jax.random.normal(k[0], (D, n_base)) / 2,
        "b": jax.random.normal(k[1], (n_base,)) / 4,
    }
    adapter = {
        "a": jax.random.normal(k[2], (D, R)) / 4,
        "b": jax.random.normal(k[3], (R, n_base)) / 4,
    }
    x = jax.random.normal(jax.random.key(seed + 1), (B, D))
    return adapter, base, x


def reference(loss, params, x, key, frozen):
    keys = unsplit.example_keys(key, jnp.arange(x.shape[0]))
    frozen = jax.tree.map(lambda a: jnp.asarray(jax.device_get(a)), frozen)

    def mean(p):
        return jnp.mean(jax.vmap(loss, in_axes=(None, 0, 0, None))(p, x, keys, frozen))

    return jax.value_and_grad(mean, argnums=0)(params)


def close(a, b, tol=1e-5):
    return all(
        np.allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"microbatches": 4},
        {"bitwise": True, "chunk_size": 4},
    ],
)
def test_values_and_grads_match_the_plain_formula(options):
    adapter, base, x = make()
    key = jax.random.key(3)
    loss, grads = unsplit.value_and_grad(lora_loss, **options)(adapter, x, key, frozen=base)
    want_loss, want_grads = reference(lora_loss, adapter, x, key, base)
    assert jax.tree.structure(grads) == jax.tree.structure(adapter)
    assert close(loss, want_loss) and close(grads, want_grads)


def fsdp(mesh, base, axis="data"):
    return {
        "w": jax.device_put(base["w"], NamedSharding(mesh, P(None, axis))),
        "b": jax.device_put(base["b"], NamedSharding(mesh, P(axis))),
    }


@pytest.mark.parametrize("explicit", [False, True])
def test_default_mode_keeps_an_fsdp_frozen_sharded(explicit):
    adapter, base, x = make()
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    sharded = fsdp(mesh, base)
    step = unsplit.value_and_grad(lora_loss, mesh=mesh, microbatches=2)
    key = jax.random.key(0)
    loss, grads = step(adapter, x, key, frozen=sharded)
    want_loss, want_grads = reference(lora_loss, adapter, x, key, base)
    assert close(loss, want_loss) and close(grads, want_grads)
    # The compiled program takes the frozen arrays sharded as given: no copy gathers them.
    compiled = step.lower(adapter, x, key, frozen=sharded).compile()
    specs = [s.spec for s in jax.tree.leaves(compiled.input_shardings[0])]
    assert P(None, "data") in specs and P("data") in specs
    assert sharded["w"].sharding.spec == P(None, "data")


def test_the_program_takes_frozen_as_an_argument_not_a_constant():
    key = jax.random.key(0)
    sizes = []
    for n in (1_000, 1_000_000):  # a base of 3e3 vs 3e6 floats
        adapter, base, x = make(n_base=n)
        step = unsplit.value_and_grad(lora_loss)
        sizes.append(len(step.lower(adapter, x, key, frozen=base).as_text()))
    assert sizes[1] < 1.1 * sizes[0]


def test_the_same_frozen_layout_does_not_retrace_and_a_new_one_compiles():
    traces = []

    def loss(p, x, key, frozen):
        traces.append(1)
        return lora_loss(p, x, key, frozen)

    adapter, base, x = make()
    step = unsplit.value_and_grad(loss)
    key = jax.random.key(0)
    step(adapter, x, key, frozen=base)
    first = len(traces)
    step(adapter, x, key, frozen=jax.tree.map(lambda a: a + 1.0, base))  # same layout
    assert len(traces) == first
    step(adapter, x, key, frozen={**base, "unused": jnp.ones(2)})  # a new structure
    second = len(traces)
    assert second > first
    step(adapter, x, key, frozen={**base, "unused": jnp.ones(3)})  # a new shape
    assert len(traces) > second


def test_bitwise_bits_are_the_same_for_every_schedule():
    adapter, base, x = make()
    key = jax.random.key(5)
    results = []
    for devices in (1, 2, 8):
        mesh = jax.make_mesh((devices,), ("data",))
        frozen = fsdp(mesh, base)  # FSDP over the batch axis: gathered like params
        step = unsplit.value_and_grad(lora_loss, mesh=mesh, bitwise=True, chunk_size=2)
        results.append(step(adapter, x, key, frozen=frozen))
    single = unsplit.value_and_grad(lora_loss, bitwise=True, chunk_size=2)
    results.append(single(adapter, x, key, frozen=base))
    first = [np.asarray(a) for a in jax.tree.leaves(results[0])]
    for other in results[1:]:
        for a, b in zip(first, jax.tree.leaves(other), strict=True):
            assert np.array_equal(a, np.asarray(b))


def test_bitwise_fsdp_groups_keep_frozen_sharded_over_the_chunk_axes():
    adapter, base, x = make()
    key = jax.random.key(5)
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    frozen = fsdp(mesh, base, axis="fsdp")
    step = unsplit.value_and_grad(
        lora_loss, mesh=mesh, batch_axes=("data", "fsdp"), bitwise=True, chunk_axes="fsdp"
    )
    loss, grads = step(adapter, x, key, frozen=frozen)
    want_loss, want_grads = reference(lora_loss, adapter, x, key, base)
    assert close(loss, want_loss) and close(grads, want_grads)
    (state,) = step._engine._plans.values()
    plan = state.plan
    # The frozen leaves (after the params') keep their fsdp specs inside each group.
    assert plan.structure.diff == (True, True, False, False)
    assert P(None, "fsdp") in plan.local_specs[2:] and P("fsdp") in plan.local_specs[2:]
    # The train step's update (on each group's shards) sees the adapters only.
    optimizer = optax.sgd(0.1)
    train = unsplit.train_step(step, optimizer)
    params = jax.tree.map(jnp.copy, adapter)
    _, params, _ = train(params, optimizer.init(params), x, key, frozen=frozen)
    assert close(params, jax.tree.map(lambda p, g: p - 0.1 * g, adapter, want_grads))
    assert frozen["w"].sharding.spec == P(None, "fsdp")


@pytest.mark.parametrize("bitwise", [False, True])
def test_train_step_updates_params_only(bitwise):
    adapter, base, x = make()
    key = jax.random.key(0)
    step = unsplit.value_and_grad(lora_loss, bitwise=bitwise)
    optimizer = optax.sgd(0.1)
    train = unsplit.train_step(step, optimizer)
    want_loss, grads = reference(lora_loss, adapter, x, key, base)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, adapter, grads)
    params = jax.tree.map(jnp.copy, adapter)
    loss, params, opt_state = train(params, optimizer.init(params), x, key, frozen=base)
    assert close(loss, want_loss) and close(params, want)
    want_loss, _ = reference(lora_loss, params, x, key, base)
    loss, params, opt_state = train(params, opt_state, x, key, frozen=base)  # reused
    assert close(loss, want_loss)
    assert jax.tree.structure(opt_state) == jax.tree.structure(optimizer.init(adapter))


@pytest.mark.parametrize("bitwise", [False, True])
def test_train_step_with_a_train_state(bitwise):
    from flax.training import train_state

    adapter, base, x = make()
    key = jax.random.key(0)
    step = unsplit.value_and_grad(lora_loss, bitwise=bitwise)
    state = train_state.TrainState.create(
        apply_fn=None, params=jax.tree.map(jnp.copy, adapter), tx=optax.sgd(0.1)
    )
    train = unsplit.train_step(step)
    want_loss, grads = reference(lora_loss, adapter, x, key, base)
    loss, state = train(state, x, key, frozen=base)
    assert int(state.step) == 1 and close(loss, want_loss)
    assert close(state.params, jax.tree.map(lambda p, g: p - 0.1 * g, adapter, grads))


def features(adapter, x, key, base):
    keep = jax.random.bernoulli(key, 0.8, x.shape)
    return jnp.tanh(jnp.where(keep, x, 0.0) @ base["w"] + (x @ adapter["a"]) @ adapter["b"])


def batch_loss(adapter, feats, base):
    logits = feats @ feats.T * jnp.mean(base["b"]) + jnp.sum(adapter["b"])
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(feats.shape[0]), jnp.arange(B)])


@pytest.mark.parametrize("options", [{"microbatches": 2}, {"bitwise": True}])
def test_a_coupled_loss_gets_frozen_last(options):
    adapter, base, x = make()
    key = jax.random.key(2)
    step = unsplit.value_and_grad(features, batch_loss=batch_loss, **options)
    loss, grads = step(adapter, x, key, frozen=base)
    keys = unsplit.example_keys(key, jnp.arange(B))

    def total(p):
        feats = jax.vmap(features, in_axes=(None, 0, 0, None))(p, x, keys, base)
        return batch_loss(p, feats, base)

    want_loss, want_grads = jax.value_and_grad(total)(adapter)
    assert close(loss, want_loss) and close(grads, want_grads)


def test_an_nnx_lora_model_split_by_lora_param():
    from flax import nnx

    model = nnx.LoRALinear(D, H, lora_rank=2, rngs=nnx.Rngs(0))
    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, ...)

    def loss(lora, x, key, base):
        model = nnx.merge(graphdef, lora, base)
        keep = jax.random.bernoulli(key, 0.8, x.shape)
        return jnp.sum(model(jnp.where(keep, x, 0.0)) ** 2)

    x = jax.random.normal(jax.random.key(1), (B, D))
    key = jax.random.key(0)
    step = unsplit.value_and_grad(loss, microbatches=2)
    value, grads = step(lora, x, key, frozen=base)
    want_value, want_grads = reference(loss, lora, x, key, base)
    assert jax.tree.structure(grads) == jax.tree.structure(lora)
    assert close(value, want_value) and close(grads, want_grads)


def test_frozen_given_to_a_three_argument_loss_is_refused():
    adapter, base, x = make()

    def loss(p, x, key):
        return jnp.sum(x @ p["a"])

    with pytest.raises(TypeError, match=r"expected a function that takes 4.*Fix: add frozen"):
        unsplit.value_and_grad(loss)(adapter, x, jax.random.key(0), frozen=base)


def test_a_loss_that_needs_frozen_called_without_it_is_refused():
    adapter, _, x = make()
    with pytest.raises(TypeError, match=r"needs a frozen argument.*Fix: pass the frozen"):
        unsplit.value_and_grad(lora_loss)(adapter, x, jax.random.key(0))


def test_a_two_argument_batch_loss_with_frozen_is_refused():
    adapter, base, x = make()
    step = unsplit.value_and_grad(features, batch_loss=lambda p, f: jnp.sum(f))
    with pytest.raises(TypeError, match=r"batch_loss\(params, features, frozen\).*takes 3"):
        step(adapter, x, jax.random.key(0), frozen=base)


def test_audit_traces_the_loss_with_frozen():
    adapter, base, x = make()
    fixed = jax.random.key(7)

    def foreign(p, x, key, frozen):
        return lora_loss(p, x, fixed, frozen)

    key = jax.random.key(0)
    assert unsplit.audit(lora_loss, adapter, x, key, frozen=base) == []
    found = unsplit.audit(foreign, adapter, x, key, frozen=base)
    assert [f.kind for f in found] == ["foreign_key"]
    with pytest.raises(unsplit.AuditError):
        unsplit.value_and_grad(foreign)(adapter, x, key, frozen=base)


def test_processes_agree_on_frozen_too():
    adapter, base, x = make()
    got = items.step_items({}, adapter, x, jax.random.key(0), frozen=base)
    assert {"frozen structure", "frozen shapes and dtypes", "frozen values"} <= set(got)
    assert all(name in items.STEP_FIXES for name in got if name.startswith("frozen"))
    assert "frozen structure" not in items.step_items({}, adapter, x, jax.random.key(0))


def test_combined_params_mark_frozen_leaves_not_differentiated():
    from unsplit._src.step import sums

    both = frozen_lib.combine({"w": jnp.ones(2), "n": jnp.int32(1)}, {"base": jnp.ones(3)})
    structure, _ = sums.Params.split(both)
    assert structure.diff == (False, True, False)
    grads = frozen_lib.params_of(structure.grads_tree([jnp.ones(2)]))
    assert grads["n"] is None and grads["w"].shape == (2,)


# The canonical blocks of these tiny dims (blocks of 2 elements) leave a few dots that XLA's
# CPU client keeps on Eigen, and the bitwise step says so; the values are checked here.
@pytest.mark.filterwarnings("ignore:bitwise mode. the compiled CPU chunk program still runs")
@pytest.mark.parametrize("bitwise", [False, True])
def test_a_tensor_parallel_frozen_keeps_its_model_axis(bitwise):
    adapter, base, x = make()
    key = jax.random.key(5)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    frozen = {
        "w": jax.device_put(base["w"], NamedSharding(mesh, P(None, "model"))),
        "b": jax.device_put(base["b"], NamedSharding(mesh, P("model"))),
    }
    chunk = {"chunk_size": 4} if bitwise else {}
    step = unsplit.value_and_grad(lora_loss, mesh=mesh, batch_axes="data", bitwise=bitwise, **chunk)
    loss, grads = step(adapter, x, key, frozen=frozen)
    want_loss, want_grads = reference(lora_loss, adapter, x, key, base)
    assert close(loss, want_loss) and close(grads, want_grads)
    if bitwise:  # the model axis makes groups of 2 devices, each keeping its frozen shards
        (state,) = step._engine._plans.values()
        assert state.plan.group_axes == ("model",)
        assert state.plan.local_specs[2:] == (P("model"), P(None, "model"))


def test_no_backward_pass_reaches_frozen():
    adapter, base, x = make()
    key = jax.random.key(0)

    def flops(compiled):
        cost = compiled.cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    frozen = flops(unsplit.value_and_grad(lora_loss).lower(adapter, x, key, frozen=base).compile())

    def in_params(both, x, key):
        return lora_loss(both["adapter"], x, key, both["base"])

    both = {"adapter": adapter, "base": base}
    trained = flops(unsplit.value_and_grad(in_params).lower(both, x, key).compile())
    keys = unsplit.example_keys(key, jnp.arange(B))

    def plain(p, f):
        return jnp.mean(jax.vmap(lora_loss, in_axes=(None, 0, 0, None))(p, x, keys, f))

    reference = flops(jax.jit(jax.value_and_grad(plain)).lower(adapter, base).compile())
    # unsplit adds a few scalar ops (the weight, the nan guard); a backward through the base
    # would add its (D, H) gradient per example: about 1.2x here.
    assert frozen <= 1.1 * reference and frozen < 0.9 * trained


def worker_disagreeing_frozen():
    """Two processes whose frozen inputs (or step numbers) differ: what each call raised."""
    me = jax.process_index()
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    adapter, base, x = make()
    replicated = NamedSharding(mesh, P())

    def on_mesh(tree):  # each process's own value, as one replicated global array
        return jax.tree.map(
            lambda a: jax.make_array_from_process_local_data(replicated, np.asarray(a)), tree
        )

    adapter, same = on_mesh(adapter), on_mesh(base)
    other = on_mesh({**base, "b": base["b"] + me})
    rows = B // jax.process_count()
    batch, ids = unsplit.global_batch(np.asarray(x)[me * rows : (me + 1) * rows], mesh)
    key = jax.random.key(0)

    def attempt(fn):
        try:
            jax.block_until_ready(fn())
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "ok"

    def step():
        return unsplit.value_and_grad(lora_loss, mesh=mesh)

    in_jit = jax.jit(lambda a, b, k, i, f: step()(a, b, k, ids=i, frozen=f))
    return {
        "equal": attempt(lambda: step()(adapter, batch, key, ids=ids, frozen=same)),
        "frozen": attempt(lambda: step()(adapter, batch, key, ids=ids, frozen=other)),
        "step number": attempt(lambda: step()(adapter, batch, key, ids=ids, frozen=same, step=me)),
        "frozen in jit": attempt(lambda: in_jit(adapter, batch, key, ids, other)),
    }


@pytest.mark.multiprocess
def test_processes_that_disagree_on_frozen_or_the_step_number_all_raise():
    from unsplit._src.processes import launch

    cases = launch.run_local_processes(
        "unsplit._src.frozen_test:worker_disagreeing_frozen", timeout_s=240
    )
    for c in cases:
        assert c["equal"] == "ok"
        assert c["frozen"].startswith("AgreementError"), c["frozen"]
        assert "frozen values" in c["frozen"] and "load the same frozen inputs" in c["frozen"]
        assert "step number: process 0 has 0; process 1 has 1" in c["step number"]
        assert "the frozen inputs" in c["frozen in jit"], c["frozen in jit"]
