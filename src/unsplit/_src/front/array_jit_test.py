import jax
import jax.numpy as jnp
import numpy as np
import pytest

from unsplit._src.front.array_jit import ArrayJit, is_static, with_static, without_static


def test_plain_arrays_take_jax_jit_itself():
    traces = []

    def double(x, y):
        traces.append(1)
        return x * 2, y

    f = ArrayJit(double, donate_argnums=(0,))
    x = jnp.ones(3)
    out, y = f(x, jnp.zeros(2))
    assert x.is_deleted() and out.tolist() == [2.0] * 3
    f(jnp.ones(3), y)
    assert len(traces) == 1  # the second call does not retrace


def test_non_array_leaves_are_static_and_come_back():
    traces = []

    def apply(model, x):
        traces.append(1)
        return {**model, "w": model["act"](model["w"] * x)}, model["n"] * x

    f = ArrayJit(apply, donate_argnums=(0,))
    model = {"w": jnp.ones(3), "act": jnp.tanh, "name": "mlp", "n": 2}
    new, scaled = f(model, jnp.float32(0.5))
    assert new["act"] is jnp.tanh and new["name"] == "mlp"
    np.testing.assert_allclose(new["w"], np.tanh(0.5), rtol=1e-6)
    assert float(scaled) == 1.0
    assert model["w"].is_deleted()  # the donated argument's arrays are donated
    new, _ = f(new, jnp.float32(0.5))
    assert len(traces) == 1  # the same static leaves: the same program
    f({**new, "act": jnp.sin}, jnp.float32(0.5))
    assert len(traces) == 2  # other static leaves: another program


def test_an_unhashable_static_leaf_is_refused_with_the_fix():
    f = ArrayJit(lambda m: m["w"])
    with pytest.raises(TypeError, match=r"must be hashable.*eqx.field\(static=True\)"):
        f({"w": jnp.ones(2), "table": _Unhashable()})


class _Unhashable:
    __hash__ = None


def test_without_and_with_static_round_trip():
    tree = {"w": jnp.ones(2), "act": jnp.tanh, "k": 3}
    stripped = without_static(tree)
    assert stripped["act"] is None and stripped["k"] == 3
    back = with_static(jax.tree.map(lambda x: x + 1, stripped), tree)
    assert back["act"] is jnp.tanh and back["k"] == 4 and back["w"].tolist() == [2.0, 2.0]


class _Refused(Exception):
    pass


@pytest.mark.parametrize("static", [False, True])
def test_check_sees_each_new_batch_signature_once_before_it_runs(static):
    seen = []

    def check(compiled):
        seen.append(compiled.memory_analysis() is not None)
        if refuse:
            raise _Refused

    def step(params, x):
        return {**params, "w": params["w"] + x.sum()}, x.sum()

    f = ArrayJit(step, donate_argnums=(0,), check=check)
    params = {"w": jnp.ones(3), **({"act": jnp.tanh} if static else {})}
    refuse = True
    with pytest.raises(_Refused):
        f(params, jnp.ones(2))
    assert not params["w"].is_deleted()  # refused before it ran: nothing donated
    refuse = False
    params, _ = f(params, jnp.ones(2))
    params, _ = f(params, jnp.ones(2))
    assert len(seen) == 2  # the refused call and the first one that ran; not the next
    params, _ = f(params, jnp.ones(4))  # a new batch shape: a new program, checked
    assert len(seen) == 3
    assert params["w"].tolist() == [9.0] * 3


def test_is_static_remembers_array_types_but_not_objects():
    assert not is_static(jnp.ones(2)) and not is_static(jnp.ones(2))  # the cached path
    assert not is_static(np.float32(1)) and not is_static(3)
    assert is_static(jnp.tanh) and is_static("relu") and is_static(None)


def test_arrays_only_calls_do_not_flatten_the_arguments_in_python(monkeypatch):
    # The host work per call of a Flax/optax train step is jax.jit's own: no Python pass over
    # the params and optimizer state (they are hundreds of leaves).
    f = ArrayJit(lambda p, x: ({"w": p["w"] + x}, x), donate_argnums=(0,))
    params, _ = f({"w": jnp.ones(2)}, jnp.float32(1))
    flattened = []
    real = jax.tree.flatten
    monkeypatch.setattr(jax.tree, "flatten", lambda *a, **k: flattened.append(1) or real(*a, **k))
    params, _ = f(params, jnp.float32(1))
    assert flattened == [] and params["w"].tolist() == [3.0, 3.0]


def test_a_static_leaf_after_array_only_calls_takes_the_filtered_path():
    f = ArrayJit(lambda m, x: m["w"] * x if "act" not in m else m["act"](m["w"] * x))
    assert f({"w": jnp.ones(2)}, 2.0).tolist() == [2.0, 2.0]
    out = f({"w": jnp.ones(2), "act": jnp.negative}, 2.0)
    assert out.tolist() == [-2.0, -2.0]
    assert f({"w": jnp.ones(2)}, 3.0).tolist() == [3.0, 3.0]  # arrays again: still right


def test_a_type_error_of_the_function_itself_is_raised_unchanged():
    def bad(x):
        raise TypeError("the user's own error")

    with pytest.raises(TypeError, match="the user's own error"):
        ArrayJit(bad)(jnp.ones(2))
