"""State updates inside a loss: what the loss changes, so the audit can see it dropped.

A per-example loss is a pure function: whatever state it updates is lost
unless it returns it. Two kinds of updates are recorded while the loss is
traced, and handed back as extra outputs of the traced function; the audit
then checks whether the loss's own outputs depend on them.

* Flax Linen: every module method call is intercepted (``nn.intercept_methods``,
  public); a variable of a mutable collection other than ``params`` that
  existed before the call and holds a new value after it is an update
  (BatchNorm's ``batch_stats``, a ``cache``). Variables created by the call
  (``sow`` into ``intermediates``) are not state updates.
* Flax NNX: the ``nnx.Variable`` s reachable from ``params`` are compared
  before and after the loss. RNG streams (``nnx.RngState``: keys and counters)
  are not state: their counters advance on every draw by design.

A module captured by the loss from outside (a closure) cannot be updated
inside a trace at all: Flax raises ``TraceContextError``.
:func:`captured_module_finding` turns that error into a finding.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import sys
import traceback
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax

from unsplit._src.audit.finding import Finding, finding, python_site


class Update(NamedTuple):
    """One recorded state update: whose, which variable, its kind and the new value (a tracer)."""

    owner: str  # "BatchNorm at 'BatchNorm_0'", "BatchStat at params.norm.mean"
    name: str  # "batch_stats/mean"; "" for an NNX Variable (the owner names it)
    kind: str  # "linen" or "nnx"
    collection: str
    value: Any


# Set while unsplit itself traces the loss a second time for its own reasons (the shardings'
# retargeting): updates seen then belong to that trace, not to the call being watched. It holds
# the serial number below which recorders are paused: those made before the pause; a recorder
# made inside (the guard of that trace itself) records.
_PAUSED: contextvars.ContextVar[int] = contextvars.ContextVar("unsplit_state_paused", default=0)
_serials = itertools.count(1)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No :class:`Recorder` made before this context records inside it."""
    token = _PAUSED.set(next(_serials))
    try:
        yield
    finally:
        _PAUSED.reset(token)


class Recorder:
    """Records state updates while a loss is traced."""

    def __init__(self) -> None:
        self.updates: list[Update] = []
        self._seen: set[int] = set()
        self._serial = next(_serials)

    @contextlib.contextmanager
    def linen(self) -> Iterator[None]:
        """Intercepts Linen module calls (a no-op context when Flax is not imported)."""
        nn = sys.modules.get("flax.linen")
        if nn is None:
            yield
            return
        with nn.intercept_methods(self._intercept):
            yield

    def _intercept(self, next_fun, args, kwargs, context):
        if self._serial < _PAUSED.get():
            return next_fun(*args, **kwargs)
        module = context.module
        before = _linen_state(module)
        out = next_fun(*args, **kwargs)
        if before:
            for (collection, name), value in _linen_state(module).items():
                old = before.get((collection, name))
                if old is None or value is old or id(value) in self._seen:
                    continue
                self._seen.add(id(value))
                where = "/".join(module.path) or type(module).__name__
                owner = f"{type(module).__name__} at {where!r}"
                self.updates.append(
                    Update(owner, f"{collection}/{name}", "linen", collection, value)
                )
        return out

    def nnx_snapshot(self, tree: Any) -> list[tuple[str, Any, Any]]:
        """(path, Variable, value) for every non-RNG NNX Variable in ``tree``."""
        nnx = sys.modules.get("flax.nnx")
        if nnx is None:
            return []
        flat, _ = jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        return [
            (jax.tree_util.keystr(path), v, v.get_value())
            for path, v in flat
            if isinstance(v, nnx.Variable) and not isinstance(v, nnx.RngState)
        ]

    def nnx_updates(self, snapshot: list[tuple[str, Any, Any]]) -> None:
        """Records the Variables of ``snapshot`` that now hold another value."""
        for path, variable, old in snapshot:
            new = variable.get_value()
            if new is not old and id(new) not in self._seen:
                self._seen.add(id(new))
                owner = f"{type(variable).__name__} at params{path}"
                self.updates.append(Update(owner, "", "nnx", type(variable).__name__, new))


def _linen_state(module: Any) -> dict[tuple[str, str], Any]:
    """A bound Linen module's own variables in mutable collections other than ``params``."""
    if getattr(module, "scope", None) is None or module.is_initializing():
        return {}
    state = {}
    for collection, variables in module.variables.items():
        if collection == "params" or not module.is_mutable_collection(collection):
            continue
        for name, value in variables.items():
            if hasattr(value, "shape") and hasattr(value, "dtype"):  # not a child module
                state[(collection, name)] = value
    return state


def dropped_message(updates: list[Update]) -> str:
    """The message of a ``dropped_state`` finding for the updates made at one line."""
    owners: dict[str, list[str]] = {}
    for u in updates:
        owners.setdefault(u.owner, []).append(u.name)
    names = "; ".join(
        owner + (f" ({', '.join(n for n in ns if n)})" if any(ns) else "")
        for owner, ns in owners.items()
    )
    first = updates[0]
    if first.kind == "linen":
        how = (
            f"the loss updates the mutable collection {first.collection!r} "
            f"(model.apply(..., mutable=[{first.collection!r}])) and discards the update"
        )
    else:
        how = "the loss updates an NNX Variable of params and never returns it"
    text = f"{how}: {names}. A per-example loss is pure, so the new value is lost"
    if first.collection in ("batch_stats", "BatchStat"):
        text += (
            ": the running statistics never change, and BatchNorm inside the loss normalizes "
            "each example over itself (the loss sees one example), whatever the batch"
        )
    return text + "."


def captured_module_finding(error: BaseException) -> Finding | None:
    """A finding for Flax's ``TraceContextError`` (a captured NNX module mutated), else ``None``."""
    errors = sys.modules.get("flax.errors")
    if errors is None or not isinstance(error, errors.TraceContextError):
        return None
    site = python_site(traceback.extract_tb(error.__traceback__))
    what = str(error).split(" (https://")[0]
    if "Rng" in what:
        return finding(
            "foreign_key",
            "the loss draws from an nnx.Rngs stream held by a module it captured from outside "
            f"(Flax: {what!r}): the noise would come from the module's stream, the same for "
            "every example and schedule, not from the example's key.",
            site,
            fix="pass the example key to the layer (nnx.Dropout(...)(x, rngs=nnx.Rngs(dropout=key))) "
            "or give the model to the loss as params",
        )
    return finding(
        "dropped_state",
        f"the loss updates a Variable of an NNX module it captured from outside (Flax: {what!r}); "
        "a per-example loss cannot keep such an update, and BatchNorm statistics inside it would "
        "see one example, never the batch.",
        site,
    )


def rng_streams(params: Any, name: str = "params") -> dict[str, str]:
    """The NNX ``Rngs`` stream keys ``params`` holds: each key's traced label (as
    :func:`unsplit._src.audit.trace.trace` names it, ``params.dropout.rngs.key.value``)
    -> its stream's name (``"default"`` for a module built from ``nnx.Rngs(0)``).

    Read from the variables' ``tag`` (Flax is not imported: ``{}`` for other params).
    """

    def is_stream_key(x: Any) -> bool:
        return type(x).__name__ == "RngKey" and isinstance(getattr(x, "tag", None), str)

    out = {}
    for path, var in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_stream_key)[0]:
        if is_stream_key(var):
            for inner, _ in jax.tree_util.tree_flatten_with_path(var)[0]:
                out[name + jax.tree_util.keystr((*path, *inner))] = var.tag
    return out
