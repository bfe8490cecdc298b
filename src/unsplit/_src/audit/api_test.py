"""The audit on its corpus (every problem at its line, nothing on clean steps) and its API."""

import importlib
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import unsplit
from unsplit import audit_corpus
from unsplit._src.audit import loss as audit_loss_lib
from unsplit._src.audit import report as audit_report
from unsplit._src.audit.finding import AuditWarning
from unsplit._src.audit.loss import audit_loss


def _corpus(module: str):
    return importlib.import_module(f"unsplit.audit_corpus.{module}")


def _marked_line(module, case: str) -> int:
    lines = pathlib.Path(module.__file__).read_text().splitlines()
    marked = [i + 1 for i, text in enumerate(lines) if re.search(rf"# expect: {case}$", text)]
    assert len(marked) == 1, f"{case}: expected one '# expect: {case}' line, got {marked}"
    return marked[0]


@pytest.mark.parametrize("case", sorted(audit_corpus.PROBLEMS))
def test_every_corpus_problem_is_found_once_with_its_kind_and_line(case):
    module_name, kind = audit_corpus.PROBLEMS[case]
    module = _corpus(module_name)
    with jax.numpy_dtype_promotion("standard"):  # user code (optax), not the tests' strict mode
        findings = audit_report.audit_factory(getattr(module, case), case)
    got = [(f.kind, os.path.realpath(f.file), f.line) for f in findings]
    assert got == [(kind, os.path.realpath(module.__file__), _marked_line(module, case))]
    assert len(findings[0].message) > 80 and findings[0].fix


@pytest.mark.parametrize("case", audit_corpus.CLEAN)
def test_clean_corpus_steps_have_no_finding(case):
    with jax.numpy_dtype_promotion("standard"):
        assert audit_report.audit_factory(getattr(_corpus("clean"), case), case) == []


def test_an_unsplit_step_is_clean_as_a_batched_step_too():
    step, args = _corpus("clean").unsplit_step()
    assert unsplit.audit_step(step, *args) == []


def test_corpus_covers_every_kind_and_enough_cases():
    kinds = {kind for _, kind in audit_corpus.PROBLEMS.values()}
    assert kinds == {
        "foreign_key",
        "cross_example",
        "dropped_state",
        "unsafe_key",
        "padding_unstable",
        "device_key",
        "batch_draw",
        "mean_of_means",
    }
    assert len(audit_corpus.PROBLEMS) >= 12 and len(audit_corpus.CLEAN) >= 4


def test_same_key_microbatches_says_the_key_repeats():
    (finding,) = audit_report.audit_factory(_corpus("batched").same_key_microbatches)
    assert "same key at every iteration" in finding.message.replace(
        "the same at every", "same key at every"
    ) or ("the key is the same at every iteration" in finding.message)


# -- trace time (the step's audit=True) -------------------------------------------------

_NOISE = jax.random.key(7)


def _closure_loss(w, x, key):
    return jnp.sum(x @ w) + jnp.sum(jax.random.normal(_NOISE, x.shape))


def _padding_loss(w, x, key):
    keep = jax.random.bernoulli(key, 0.9, (x.shape[0], x.shape[0]))  # (L, L): not prefix-stable
    return jnp.sum(jnp.where(keep, x @ x.T, 0.0)) + jnp.sum(w)


def test_audit_loss_runs_inside_a_jit_trace_on_abstract_values():
    found = []

    @jax.jit
    def step(w, batch, key):
        found.extend(audit_loss(_closure_loss, w, batch[0], key))
        found.extend(audit_loss(_padding_loss, w, batch[0], key))
        return jnp.sum(batch)

    step(jnp.ones(4), jnp.ones((2, 6, 4)), jax.random.key(0))
    assert [f.kind for f in found] == ["foreign_key", "padding_unstable"]


def test_audit_loss_runs_inside_shard_map_where_the_batch_axis_is_bound():
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    found = []

    def collective_loss(w, x, key):
        return jnp.sum(jax.lax.pmean(x @ w, "data"))

    def body(w, batch, key):
        found.extend(audit_loss(collective_loss, w, batch[0], key))
        found.extend(audit_loss(_padding_loss, w, batch[0], key))
        return jax.lax.psum(jnp.sum(batch), "data")

    specs = (jax.P(), jax.P("data"), jax.P())
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=jax.P()))
    step(jnp.ones(4), jnp.ones((4, 6, 4)), jax.random.key(0))
    assert [f.kind for f in found] == ["cross_example", "padding_unstable"]


def test_audit_loss_accepts_shape_dtype_structs_and_kinds():
    w = jax.ShapeDtypeStruct((4,), jnp.float32)
    x = jax.ShapeDtypeStruct((6, 4), jnp.float32)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    assert [f.kind for f in audit_loss(_padding_loss, w, x, key)] == ["padding_unstable"]
    assert audit_loss(_padding_loss, w, x, key, kinds={"foreign_key", "dropped_state"}) == []


def test_audit_loss_gives_no_finding_when_the_loss_itself_fails():
    def broken(w, x, key):
        return jnp.sum(x @ jnp.ones((99, 2)))  # shape error: the step will raise it itself

    assert audit_loss(broken, jnp.ones(4), jnp.ones((6, 4)), jax.random.key(0)) == []


def test_an_audit_bug_becomes_an_audit_error_finding(monkeypatch):
    def crash(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(audit_loss_lib, "foreign_key_findings", crash)
    (finding,) = audit_loss(_closure_loss, jnp.ones(4), jnp.ones((6, 4)), jax.random.key(0))
    assert finding.kind == "audit_error" and "RuntimeError: boom" in finding.message


@pytest.mark.parametrize(
    ("kinds", "error", "message"),
    [
        ({"batch_draw"}, ValueError, "not per-example checks"),
        ("foreign_key", TypeError, "kinds={'foreign_key'}"),
    ],
)
def test_audit_loss_rejects_wrong_kinds(kinds, error, message):
    with pytest.raises(error, match=re.escape(message)):
        audit_loss(_closure_loss, jnp.ones(4), jnp.ones((6, 4)), jax.random.key(0), kinds=kinds)


# -- unsplit.audit's and audit_step's inputs --------------------------------------------

_W, _BATCH, _KEY = jnp.ones(4), jnp.ones((8, 6, 4)), jax.random.key(0)


def _mean(w, x, key):
    return jnp.mean(unsplit.dropout(key, x, 0.1) @ w)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: unsplit.audit("loss", _W, _BATCH, _KEY), TypeError, "loss_fn must be a function"),
        (lambda: unsplit.audit(_mean, _W, {}, _KEY), ValueError, "batch has no array leaves"),
        (
            lambda: unsplit.audit(_mean, _W, {"a": jnp.ones((8, 2)), "b": jnp.ones((4,))}, _KEY),
            ValueError,
            "same leading size",
        ),
        (
            lambda: unsplit.audit(_mean, _W, _BATCH, _KEY, weighted=True),
            TypeError,
            "(loss_sum, weight)",
        ),
        (
            lambda: unsplit.audit(lambda w, x, k: (_mean(w, x, k), 1.0), _W, _BATCH, _KEY),
            TypeError,
            "pass weighted=True",
        ),
        (lambda: unsplit.audit(lambda w, x, k: x @ w, _W, _BATCH, _KEY), TypeError, "scalar loss"),
        (lambda: unsplit.audit(_mean, _W, _BATCH, _KEY, has_aux=True), TypeError, "(loss, aux)"),
        (lambda: unsplit.audit(_mean, _W, _BATCH, jnp.ones(3)), TypeError, "jax.random.key(seed)"),
        (
            lambda: unsplit.audit_step(_mean, _W, _BATCH, _KEY, batch_argnums=(5,)),
            ValueError,
            "batch_argnums=(5,)",
        ),
    ],
)
def test_input_errors_say_what_was_expected_and_the_fix(call, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        call()
    assert "Fix" in str(info.value)


def test_audit_accepts_aux_and_reports_an_rbg_step_key():
    def with_aux(w, x, key):
        return _mean(w, x, key), {"norm": jnp.sum(x)}

    assert unsplit.audit(with_aux, _W, _BATCH, _KEY, has_aux=True) == []
    (finding,) = unsplit.audit(_mean, _W, _BATCH, jax.random.key(0, impl="rbg"))
    assert finding.kind == "unsafe_key"  # at the loss's line that draws from the key
    assert (finding.file, finding.line) == (__file__, _mean.__code__.co_firstlineno + 1)


def test_an_rbg_default_impl_is_named_with_the_line_that_draws():
    with jax.default_prng_impl("rbg"):
        (finding,) = unsplit.audit(_mean, _W, _BATCH, jax.random.key(0))
        assert (finding.kind, finding.line) == ("unsafe_key", _mean.__code__.co_firstlineno + 1)
        assert "jax_default_prng_impl is 'rbg'" in finding.message

        def step(w, x, seed):
            key = jax.random.PRNGKey(seed)
            return jnp.sum(x @ w) * jnp.sum(jax.random.uniform(key, (3,)))

        (finding,) = unsplit.audit_step(step, _W, _BATCH, 0)
    assert (finding.kind, finding.file) == ("unsafe_key", __file__)
    assert finding.line == step.__code__.co_firstlineno + 2
    assert "jax_default_prng_impl is 'rbg'" in finding.message


def test_audit_reraises_the_loss_error_with_a_note():
    def broken(w, x, key):
        raise ValueError("my loss is broken")

    with pytest.raises(ValueError, match="my loss is broken") as info:
        unsplit.audit(broken, _W, _BATCH, _KEY)
    assert "in_axes=(None, 0, 0)" in "".join(info.value.__notes__)


def test_audit_step_warns_when_no_argument_looks_like_the_batch():
    def step(params, key):  # a scalar leaf: params cannot be a batch
        return jnp.sum(params["w"] * jax.random.normal(key, (3, 3))) * params["scale"]

    params = {"w": jnp.ones((3, 3)), "scale": jnp.ones(())}
    with pytest.warns(AuditWarning, match="batch_argnums"):
        assert unsplit.audit_step(step, params, _KEY) == []


def test_audit_step_batch_argnums_overrides_the_guess():
    def step(x, w, key):  # the batch first: the guess would take w
        return jnp.sum(jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0) @ w)

    (finding,) = unsplit.audit_step(
        step, jnp.ones((8, 3)), jnp.ones((3, 2)), _KEY, batch_argnums=(0,)
    )
    assert finding.kind == "batch_draw"


def test_finding_is_a_frozen_dataclass_with_the_contract_fields():
    f = unsplit.Finding("batch_draw", "one key", "use unsplit", "step.py", 12)
    assert (f.kind, f.message, f.fix, f.file, f.line) == (
        "batch_draw",
        "one key",
        "use unsplit",
        "step.py",
        12,
    )
    assert f.to_dict()["line"] == 12 and str(f) == "step.py:12: batch_draw: one key"
    with pytest.raises(AttributeError):
        f.kind = "other"


# -- issue 40: audit_step takes frozen=; the NNX reseed fix names the model's streams ----


def test_audit_step_takes_frozen_inputs_as_the_step_does():
    def step(w, batch, key, *, frozen):  # the base is frozen, never the batch
        keep = jax.random.bernoulli(key, 0.9, batch.shape)  # one key for the whole batch
        return jnp.sum(jnp.where(keep, batch, 0.0) @ frozen["w"] @ w)

    base = {"w": jnp.ones((3, 8))}  # a leading size of 3, like nothing in the batch
    (found,) = unsplit.audit_step(step, jnp.ones((8, 2)), jnp.ones((8, 3)), _KEY, frozen=base)
    assert found.kind == "batch_draw"

    def unsplit_loss(w, x, key, frozen):
        return jnp.sum(unsplit.dropout(key, x, 0.1) @ frozen["w"] @ w)

    train = unsplit.train_step(unsplit.value_and_grad(unsplit_loss), optax.sgd(0.1))
    w = jnp.ones((8, 2))
    args = (w, optax.sgd(0.1).init(w), jnp.ones((8, 3)), _KEY)
    assert unsplit.audit_step(train, *args, frozen=base) == []


def test_a_reseed_of_a_stream_the_module_lacks_gets_the_fix_naming_its_streams():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    model = Model(nnx.Rngs(0))  # one stream: 'default', which the Dropout falls back to

    def reseeds_dropout(model, x, key):  # the docs' recipe for nnx.Rngs(dropout=...)
        nnx.reseed(model, dropout=key)
        return jnp.sum(model(x) ** 2)

    def reseeds_default(model, x, key):
        nnx.reseed(model, default=key)
        return jnp.sum(model(x) ** 2)

    x = jnp.ones((8, 4))
    (found,) = unsplit.audit(reseeds_dropout, model, x, _KEY)
    assert found.kind == "foreign_key"
    assert "the module's own nnx.Rngs stream 'default'" in found.message
    assert "nnx.reseed(model, default=key)" in found.fix
    assert "the streams this model has: default" in found.fix
    assert unsplit.audit(reseeds_default, model, x, _KEY) == []
    with_dropout = Model(nnx.Rngs(params=0, dropout=1))
    assert unsplit.audit(reseeds_dropout, with_dropout, x, _KEY) == []


def test_audit_refuses_a_frozen_mismatch_with_the_steps_message():
    def needs_frozen(w, x, key, base):
        return jnp.sum(unsplit.dropout(key, x, 0.1) @ base @ w)

    def takes_none(w, x, key):
        return jnp.sum(unsplit.dropout(key, x, 0.1) @ w)

    w, x, base = jnp.ones(2), jnp.ones((8, 3)), jnp.ones((3, 2))
    with pytest.raises(TypeError, match=r"needs a frozen argument.*frozen=frozen"):
        unsplit.audit(needs_frozen, w, x, _KEY)
    with pytest.raises(TypeError, match=r"frozen= was given.*add frozen as its last parameter"):
        unsplit.audit(takes_none, w, x, _KEY, frozen=base)
    assert unsplit.audit(needs_frozen, w, x, _KEY, frozen=base) == []
