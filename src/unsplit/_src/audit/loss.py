"""The per-example checks: a loss of ONE example, traced and walked.

:func:`audit_loss` is what ``unsplit.audit`` runs after checking the batch,
and what a step can run at trace time (``value_and_grad(..., audit=True)``):
it takes one abstract example (``jax.ShapeDtypeStruct`` s are fine), never
runs the model, and never raises: a loss that fails to trace gives no
findings (the step then raises the loss's own error), and a failure of the
audit itself is reported as an ``audit_error`` finding.

The rules, on the walk of ``loss_fn(params, example, key)``:

* ``foreign_key``: a draw whose key does not depend on ``key`` (the example
  key): a closed-over key, ``jax.random.key(0)``, a key held in ``params``
  (an ``nnx.Rngs`` stream inside the module), a key made from the example's
  data alone. Draws with one root are reported once, at the first draw.
* ``cross_example``: a named-axis collective (``psum``, ``pmean``,
  ``all_gather``, ``ppermute``, ``axis_index``, ...). The loss sees one example,
  so ordinary reductions cannot cross examples under ``jax.vmap``; a
  collective is the only way, and under ``value_and_grad`` it binds to the
  mesh's batch axis (``BatchNorm(axis_name=...)`` does this).
* ``device_key``: a draw whose key depends on the device (``axis_index``).
* ``dropped_state``: state updated inside the loss that its outputs do not
  depend on (see :mod:`unsplit._src.audit.state`).
* ``unsafe_key``: a draw from an ``rbg``/``unsafe_rbg`` key.
* ``padding_unstable``: see :mod:`unsplit._src.audit.padding`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from unsplit._src import frozen as frozen_lib
from unsplit._src.audit import trace as audit_trace
from unsplit._src.audit.finding import (  # AuditError, raise_for: re-exported for the step
    PER_EXAMPLE_KINDS,
    UNKNOWN,
    AuditError,
    Finding,
    Site,
    audit_error,
    dedupe,
    finding,
    raise_for,
)
from unsplit._src.audit.graph import Walker, roots
from unsplit._src.audit.keys import THREEFRY_DTYPE, Draw, KeyRules, default_impl_note
from unsplit._src.audit.padding import Program, padding_findings
from unsplit._src.audit.state import Recorder, captured_module_finding, dropped_message, rng_streams
from unsplit._src.audit.values import Info, Node, Origin

__all__ = ["AuditError", "audit_loss", "check_loss", "raise_for"]


class LossTraceError(Exception):
    """The user's loss failed to trace (its own error is the ``__cause__``)."""


@dataclasses.dataclass
class _Walked:
    program: Program
    rules: KeyRules
    loss_outputs: list[Node]
    updates: list[tuple[Any, Node]]  # (recorder Update, node)


def audit_loss(
    loss_fn: Callable,
    params: Any,
    example: Any,
    key: Any,
    *,
    weighted: bool = False,
    kinds: Iterable[str] | None = None,
    frozen: Any = None,
) -> list[Finding]:
    """Per-example findings for ``loss_fn`` on ONE example; never raises.

    Args:
        loss_fn: ``loss_fn(params, example, key)`` for one example.
        params: the params (arrays, tracers or ``jax.ShapeDtypeStruct`` s).
        example: one example, without the batch axis (same leaf types).
        key: the example's key: a typed key of shape ``()`` or its
            ``ShapeDtypeStruct`` (or a legacy ``uint32[2]`` key).
        weighted: whether ``loss_fn`` returns ``(loss_sum, weight)``; both
            count as the loss's outputs.
        kinds: the checks to run (default: all per-example kinds). The
            padding check traces the loss a second time; ``{"foreign_key",
            "dropped_state"}`` is one trace.
        frozen: frozen inputs, if any: the loss is then traced as
            ``loss_fn(params, example, key, frozen)``, as the step calls it.

    Returns:
        The findings (``audit_error`` if the audit itself failed); ``[]``
        when the loss itself does not trace.

    Raises:
        TypeError, ValueError: ``kinds`` names something other than the
            per-example kinds (a mistake of the caller, not of the loss).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from unsplit._src.audit.loss import audit_loss
        >>> noise = jax.random.key(0)
        >>> def loss(w, x, key):
        ...     return jnp.sum(x * w + jax.random.normal(noise, x.shape))
        >>> x = jax.ShapeDtypeStruct((4,), jnp.float32)
        >>> [f.kind for f in audit_loss(loss, jnp.ones(4), x, jax.random.key(1))]
        ['foreign_key']
    """
    del weighted  # every output of the loss counts as used, weighted or not
    _check_kinds(kinds)
    if frozen is not None:  # traced as the step calls it: frozen travels with the params
        loss_fn, params = frozen_lib.bound(loss_fn), frozen_lib.combine(params, frozen)
    try:
        return check_loss(loss_fn, params, example, key, kinds=kinds)
    except LossTraceError:
        return []
    except Exception as e:  # an audit bug must never break the user's step
        return [audit_error(e)]


def check_loss(
    loss_fn: Callable, params: Any, example: Any, key: Any, *, kinds: Iterable[str] | None = None
) -> list[Finding]:
    """Like :func:`audit_loss`, but raises :class:`LossTraceError` when the loss does not trace."""
    kinds = _check_kinds(kinds)
    key = audit_trace.abstract(key)
    walked = _trace_and_walk(loss_fn, params, example, key, "dropped_state" in kinds)
    if isinstance(walked, Finding):  # Flax refused a captured module's update
        return [walked] if walked.kind in kinds else []
    draws = walked.rules.draws_of()
    found = []
    if "unsafe_key" in kinds:
        found += unsafe_key_findings(draws)
    if "foreign_key" in kinds:
        found += foreign_key_findings(draws, rng_streams(params))
    if "device_key" in kinds:
        found += device_key_findings(draws)
    if "cross_example" in kinds:
        found += cross_example_findings(walked.rules.collectives, draws)
    if "dropped_state" in kinds:
        found += dropped_state_findings(walked)
    if "padding_unstable" in kinds:
        short = audit_trace.shrink_example(audit_trace.abstract_tree(example))
        if short is not None:
            try:
                other = _trace_and_walk(loss_fn, params, short, key, record_state=False)
            except LossTraceError:  # no shorter length exists for this loss: nothing to pad
                other = None
            if isinstance(other, _Walked):
                found += padding_findings(walked.program, other.program)
    return dedupe(found)


def _check_kinds(kinds: Iterable[str] | None) -> frozenset[str]:
    if kinds is None:
        return PER_EXAMPLE_KINDS
    if isinstance(kinds, str):
        raise TypeError(
            f"kinds must be a collection of kinds; got the string {kinds!r}. Fix: kinds={{{kinds!r}}}."
        )
    kinds = frozenset(kinds)
    unknown = sorted(kinds - PER_EXAMPLE_KINDS)
    if unknown:
        raise ValueError(
            f"kinds={sorted(kinds)} names {unknown}, which are not per-example checks; expected "
            f"some of {sorted(PER_EXAMPLE_KINDS)}. Fix: drop them (batched kinds are audit_step's)."
        )
    return kinds


def _trace_and_walk(loss_fn, params, example, key, record_state: bool) -> _Walked | Finding:
    recorder = Recorder()

    def wrapped(params, example, key):
        if not record_state:
            return loss_fn(params, example, key), []
        with recorder.linen():
            snapshot = recorder.nnx_snapshot(params)
            out = loss_fn(params, example, key)
        recorder.nnx_updates(snapshot)
        return out, [u.value for u in recorder.updates]

    try:
        traced = audit_trace.trace(wrapped, [params, example, key], ["params", "example", "key"])
    except Exception as e:
        captured = captured_module_finding(e)
        if captured is not None:
            return captured
        if record_state and recorder.updates:  # maybe an update made inside an inner transform
            return _trace_and_walk(loss_fn, params, example, key, record_state=False)
        raise LossTraceError(f"{type(e).__name__}: {e}") from e
    rules = KeyRules()
    walker = Walker(rules)
    outs = walker.run(traced.closed, _input_infos(traced.leaves), _const_origin)
    n_loss = len(jax.tree_util.tree_leaves(traced.out_shape[0]))
    key_node = walker.inputs[-1]
    program = Program(walker, key_node, outs[:n_loss], rules.draws)
    updates = list(zip(recorder.updates, outs[n_loss:], strict=True)) if record_state else []
    return _Walked(program, rules, outs[:n_loss], updates)


def _input_infos(leaves: Sequence[audit_trace.Leaf]) -> list[Info]:
    shared = Origin("param", "params")
    infos = []
    for leaf in leaves:
        if leaf.arg == 2:
            infos.append(frozenset({Origin("example_key", "the example key")}))
        elif leaf.arg == 1:
            infos.append(frozenset({Origin("data", leaf.path)}))
        elif audit_trace.is_key(leaf.aval):
            infos.append(frozenset({Origin("param", leaf.path)}))
        else:
            infos.append(frozenset({shared}))
    return infos


def _const_origin(index: int, value: Any) -> Origin:
    aval = jax.typeof(value).str_short() if hasattr(value, "dtype") else type(value).__name__
    return Origin("const", f"a constant {aval} the loss closes over")


def unsafe_key_findings(draws: Sequence[Draw]) -> list[Finding]:
    out = []
    for d in draws:
        if d.key_dtype.startswith("key<") and d.key_dtype != THREEFRY_DTYPE:
            out.append(
                finding(
                    "unsafe_key",
                    f"this draw uses a {d.key_dtype} key (rbg or unsafe_rbg)"
                    f"{default_impl_note()}: under jax.vmap such "
                    "keys draw the whole batch from the first example's key, so an example's "
                    "noise depends on which examples share its batch.",
                    d.site,
                )
            )
    return out


def foreign_key_findings(
    draws: Sequence[Draw], streams: dict[str, str] | None = None
) -> list[Finding]:
    """``streams``: the params' NNX stream keys by label (:func:`.state.rng_streams`)."""
    streams = streams or {}
    groups: dict[Info, list[Draw]] = {}
    for d in draws:
        if not any(o.kind == "example_key" for o in d.key_info):
            groups.setdefault(roots(d.key_info), []).append(d)
    out = []
    for root, group in groups.items():
        where = _where(group)
        message = f"{_foreign_cause(root, streams)}{where}"
        out.append(finding("foreign_key", message, group[0].site, _reseed_fix(root, streams)))
    return out


def _reseed_fix(root: Info, streams: dict[str, str]) -> str | None:
    """For a draw from a module's own NNX stream: reseed the streams it has (by name)."""
    drawn = sorted({streams[o.label] for o in root if o.kind == "param" and o.label in streams})
    if not drawn:
        return None
    named = ", ".join(f"{t}=key" for t in drawn)
    return (
        f"reseed the module's streams from the loss's `key` first: nnx.reseed(model, {named}) "
        f"(the streams this model has: {', '.join(sorted(set(streams.values())))}; a stream "
        "the model does not have, such as dropout= on layers built from nnx.Rngs(0), whose "
        "stream is 'default', changes nothing); or call the layer with rngs=nnx.Rngs(key)"
    )


def _foreign_cause(root: Info, streams: dict[str, str]) -> str:
    by_kind = {o.kind: o for o in sorted(root, key=lambda o: o.label)}
    keyed_param = [o for o in root if o.kind == "param" and o.label != "params"]
    if "seed" in by_kind:
        seed = by_kind["seed"]
        cause = f"this draw's key is made inside the loss by {seed.label} (at {seed.site})"
    elif keyed_param and keyed_param[0].label in streams:
        cause = (
            f"this draw's key is read from {keyed_param[0].label}, the module's own nnx.Rngs "
            f"stream '{streams[keyed_param[0].label]}' (an nnx.reseed of another stream "
            "leaves it as it is), not derived from the example's key"
        )
    elif keyed_param:
        cause = (
            f"this draw's key is read from {keyed_param[0].label} (a stream held by the module, "
            "such as its own nnx.Rngs), not derived from the example's key"
        )
    elif "const" in by_kind:
        cause = (
            f"this draw's key is {by_kind['const'].label} (a closure, a global, or "
            "rngs={'dropout': captured_key}), not the example's key"
        )
    elif "data" in by_kind:
        cause = (
            f"this draw's key is computed from the example's data ({by_kind['data'].label}) alone"
        )
    else:
        cause = "this draw's key is a constant"
    return (
        f"{cause}: every example gets noise from the same key whatever its id, so the noise "
        "is tied across examples (and repeats at every step) instead of being a function of "
        "the example's global id"
    )


def device_key_findings(draws: Sequence[Draw]) -> list[Finding]:
    """``device_key`` findings, one per device origin, at the origin's line."""
    origins: dict[Origin, list[Draw]] = {}
    for d in draws:
        for o in d.key_info:
            if o.kind == "device":
                origins.setdefault(o, []).append(d)
    out = []
    for origin, group in origins.items():
        message = (
            f"the key of this draw depends on the device: {origin.label}. Each device draws "
            "from its own key, so an example's noise changes with the number of devices and "
            f"with the device that holds it{_where(group)}"
        )
        # A map that is the step itself (jax.pmap(step)) has no user line: the draw's is.
        site = origin.site if origin.site and origin.site.file else group[0].site
        out.append(finding("device_key", message, site))
    return out


def cross_example_findings(collectives: Sequence[Any], draws: Sequence[Draw]) -> list[Finding]:
    """Collectives in the loss; an ``axis_index`` that only makes a key is a ``device_key``."""
    key_axes = {o.site for d in draws for o in d.key_info if o.kind == "device"}
    return [
        _cross_example(c.eqn, c.site)
        for c in collectives
        if not (c.eqn.primitive.name == "axis_index" and c.site in key_axes)
    ]


def _cross_example(eqn: Any, site: Site) -> Finding:
    name = eqn.primitive.name
    axes = eqn.params.get("axes", eqn.params.get("axis_name"))
    return finding(
        "cross_example",
        f"{name} over the named axis {axes!r} inside the per-example loss: it combines values "
        "of other examples (or reveals the device), and under value_and_grad that name binds "
        "to the mesh's batch axis, so the loss of one example depends on which examples share "
        "its devices and on how many there are. BatchNorm(axis_name=...) does this.",
        site,
    )


def dropped_state_findings(walked: _Walked) -> list[Finding]:
    used = _ancestors(walked.loss_outputs)
    by_site: dict[Site, list[Any]] = {}
    for update, node in walked.updates:
        if id(node) in used:
            continue  # the loss returns it (e.g. in aux): not dropped
        site = node.producer.site if node.producer is not None else UNKNOWN
        by_site.setdefault(site, []).append(update)
    return [finding("dropped_state", dropped_message(u), s) for s, u in by_site.items()]


def _ancestors(nodes: Sequence[Node]) -> set[int]:
    seen: set[int] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            if node.producer is not None:
                stack.extend(node.producer.ins)
    return seen


def _where(group: Sequence[Draw]) -> str:
    sites = list(dict.fromkeys(d.site for d in group))
    if len(sites) <= 1:
        return "."
    more = ", ".join(str(s) for s in sites[1:4]) + (", ..." if len(sites) > 4 else "")
    return f" (also drawn at {more})."
