"""The batched-step checks: an ordinary train step, before it adopts unsplit.

* ``batch_draw``, two signals. (1) The step is traced twice, with the batch
  and with a batch twice as large (the batch arguments are ``batch_argnums``,
  by default the ones whose array leaves share one leading size; see
  :func:`unsplit._src.audit.trace.infer_batch_argnums`; a ``jax.pmap`` ped
  step's batch, stacked per device, grows per device). A draw whose drawn
  shape changes while its key's shape does not is one key drawing noise for a
  whole (micro)batch. Per-example keys (``jax.vmap`` over ``example_keys``)
  change the key's shape with the batch, so they pass. (2) Where the noise
  meets the batch's rows (:mod:`unsplit._src.audit.rows`): a draw from one key
  (per loop iteration) whose own axis is combined elementwise with an axis of
  rows of the batch; this finds microbatch loops whose size is a constant of
  the code, for which doubling the batch changes nothing that is drawn.
* ``device_key``: a draw whose key depends on ``axis_index`` or on a key
  array that ``shard_map``/``pmap`` splits over devices
  (``flax.training.common_utils.shard_prng_key``), reported at that line.
* ``mean_of_means``: a *batch statistic* is a reduction to a scalar of batch
  data alone (``jnp.sum(mask)``: a token count). Dividing by one inside an
  accumulation loop whose carry adds the result up (a ``lax.scan`` or
  ``fori_loop`` over microbatches), or feeding such a quotient into the
  ``acc_grads`` of an ``optax.MultiSteps`` state, is a mean of microbatch
  means. Dividing by a constant (an unweighted mean of equal microbatches) is
  not reported: the mean of equal-size means is the global mean.
* ``unsafe_key``: as for a per-example loss.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from unsplit._src.audit import batch_draw
from unsplit._src.audit import trace as audit_trace
from unsplit._src.audit.finding import UNKNOWN, AuditWarning, Finding, dedupe, finding
from unsplit._src.audit.graph import Walker, roots
from unsplit._src.audit.keys import Draw, KeyRules
from unsplit._src.audit.loss import device_key_findings, unsafe_key_findings
from unsplit._src.audit.rows import RowRules, draw_tag, pmap_stacked
from unsplit._src.audit.values import Ctx, Info, Loop, Node, Origin

_REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"}
)


class BatchedRules(RowRules):
    """:class:`RowRules` plus batch statistics, per-microbatch means and accumulations, and
    which inputs a ``jax.pmap`` takes stacked per device."""

    def __init__(self, in_rows: Sequence[frozenset[int]] = ()) -> None:
        super().__init__(in_rows)
        self.findings: list[Finding] = []
        self.stacked: set[int] = set()  # ids of the nodes a pmap takes stacked per device

    def enter_map(self, eqn: Any, ins: Sequence[Node], ctx: Ctx) -> list[Info]:
        self.stacked |= {id(node) for i, node in enumerate(ins) if pmap_stacked(eqn, i)}
        return super().enter_map(eqn, ins, ctx)

    def transfer(self, eqn: Any, ins: Sequence[Node], outs: Sequence[Node], ctx: Ctx) -> None:
        super().transfer(eqn, ins, outs, ctx)
        name = eqn.primitive.name
        if name in _REDUCTIONS and outs[0].aval.ndim == 0 and _data_only(ins[0].info):
            loops = frozenset(o.tag for o in ins[0].info if o.kind == "loop")
            stat = Origin("batch_stat", "a statistic of the batch", ctx.site_of(eqn), tag=loops)
            for node in outs:
                node.info = node.info | {stat}
        divisor = _divisor(name, eqn, ins)
        # Only a divisor that is itself a batch statistic (not merely influenced by one).
        if divisor is not None and _data_only(divisor.info):
            for stat in (o for o in divisor.info if o.kind == "batch_stat"):
                label = f"a batch statistic computed at {stat.site}"
                mean = Origin("batch_mean", label, ctx.site_of(eqn), tag=stat.tag)
                for node in outs:
                    node.info = node.info | {mean}

    def loop_exit(self, loop: Loop, carry_in: Sequence[Node], carry_out: Sequence[Node]) -> None:
        for i, out in enumerate(carry_out):
            if not any(o.kind == "carry" and o.tag == (loop.marker.tag, i) for o in out.info):
                continue  # not accumulated across iterations
            for mean in out.info:
                if mean.kind == "batch_mean" and loop.marker.tag in mean.tag:
                    self.findings.append(_mean_of_means(mean, f"the loop at {loop.marker.site}"))


def _data_only(info: Info) -> bool:
    kinds = {o.kind for o in roots(info)}
    return kinds == {"data"}


def _divisor(name: str, eqn: Any, ins: Sequence[Node]) -> Node | None:
    if name == "div" and len(ins) == 2:
        return ins[1]
    if name == "integer_pow" and eqn.params.get("y", 0) < 0:
        return ins[0]
    return None


def _mean_of_means(mean: Origin, accumulator: str) -> Finding:
    return finding(
        "mean_of_means",
        f"this divides by a statistic of the microbatch (such as its token count: "
        f"{mean.label}) and {accumulator} accumulates the "
        "quotient across microbatches: a mean of microbatch means, which weights the tokens "
        "of small microbatches more and changes with how the batch is cut.",
        mean.site or UNKNOWN,
    )


def check_step(
    fn: Callable, args: Sequence[Any], *, batch_argnums: Sequence[int] | None = None
) -> list[Finding]:
    """Batched-step findings for ``fn(*args)``; raises what tracing ``fn`` raises."""
    argnums = (
        audit_trace.infer_batch_argnums(args) if batch_argnums is None else tuple(batch_argnums)
    )
    names = [f"args[{i}]" for i in range(len(args))]
    traced = audit_trace.trace(fn, args, names, numpy_static=True, keep_sharding=True)
    rules, walker, outs = _walk(traced, argnums)
    if batch_argnums is None and rules.stacked:
        # A jax.pmap takes every argument stacked per device (params replicated by
        # flax.jax_utils.replicate too): its batch is the arguments of one size per device.
        stacked = {leaf.arg for leaf, n in zip(traced.leaves, walker.inputs, strict=True)
                   if id(n) in rules.stacked}  # fmt: skip
        per_device = [a if i in stacked else None for i, a in enumerate(args)]
        inferred = audit_trace.infer_batch_argnums(per_device, axis=1)
        if inferred and inferred != argnums:
            argnums = inferred
            rules, walker, outs = _walk(traced, argnums)
    draws = rules.draws_of()
    found = unsafe_key_findings(draws) + device_key_findings(draws) + rules.findings
    found += _multisteps(outs, traced.out_shape)
    stacked = frozenset(
        leaf.path
        for leaf, node in zip(traced.leaves, walker.inputs, strict=True)
        if leaf.arg in argnums and id(node) in rules.stacked
    )
    if not argnums:
        warnings.warn(
            "unsplit.audit_step: no argument looks like the batch (array leaves sharing one "
            "leading size), so batch_draw and mean_of_means were not checked. Fix: pass "
            "batch_argnums=(i,).",
            AuditWarning,
            stacklevel=3,
        )
        return dedupe(found)
    groups: dict[tuple, list[Draw]] = {}
    try:
        resized = audit_trace.resize_batch(args, argnums, 2, stacked)
        larger = audit_trace.trace(fn, resized, names, numpy_static=True, keep_sharding=True)
    except Exception as e:
        warnings.warn(
            f"unsplit.audit_step: batch_draw was checked only where noise meets the batch's "
            f"rows: the step does not trace with the batch (arguments {argnums}) twice as "
            f"large ({type(e).__name__}: {e}).",
            AuditWarning,
            stacklevel=3,
        )
    else:
        other = KeyRules()
        infos, consts = _infos(larger.leaves, argnums), _const_origin(larger, argnums)
        Walker(other).run(larger.closed, infos, consts)
        groups = batch_draw.doubling_groups(draws, other.draws_of())
    found += batch_draw.group_findings(groups)
    found += batch_draw.row_draw_findings(draws, rules.meetings, groups)
    seen = {draw_tag(d.ctx, d.eqn) for g in groups.values() for d in g} | set(rules.meetings)
    infos, consts = _infos(traced.leaves, argnums), _const_origin(traced, argnums)
    found += batch_draw.stacked_draw_findings(traced, argnums, infos, consts, seen)
    return dedupe(found)


def _walk(traced: audit_trace.Traced, argnums: tuple[int, ...]) -> tuple:
    """The batched rules walked over ``traced`` with ``argnums`` as the batch."""
    in_rows = [frozenset({0} if leaf.arg in argnums else ()) for leaf in traced.leaves]
    rules = BatchedRules(in_rows)
    walker = Walker(rules)
    outs = walker.run(traced.closed, _infos(traced.leaves, argnums), _const_origin(traced, argnums))
    return rules, walker, outs


def _multisteps(outs: Sequence[Node], out_shape: Any) -> list[Finding]:
    """``mean_of_means`` for quotients reaching an ``optax.MultiSteps`` accumulator."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    found = []
    for path, node in zip(paths, outs, strict=True):
        if not any(getattr(k, "name", None) == "acc_grads" for k in path):
            continue
        for mean in node.info:
            if mean.kind == "batch_mean":
                found.append(_mean_of_means(mean, "optax.MultiSteps (acc_grads)"))
    return found


def _infos(leaves: Sequence[audit_trace.Leaf], argnums: Sequence[int]) -> list[Info]:
    shared = Origin("param", "the step's other arguments")
    infos = []
    for leaf in leaves:
        if leaf.arg in argnums:
            infos.append(frozenset({Origin("data", leaf.path)}))
        elif audit_trace.is_key(leaf.aval):
            infos.append(frozenset({Origin("key_arg", leaf.path)}))
        else:
            infos.append(frozenset({shared}))
    return infos


def _const_origin(traced: audit_trace.Traced, argnums: Sequence[int]) -> Callable:
    """Constants that are the batch's NumPy leaves (held static) are batch data."""
    batch = [(path, value) for arg, path, value in traced.static if arg in argnums]

    def origin(index: int, value: Any) -> Origin:
        for path, leaf in batch:
            if _same_array(value, leaf):
                return Origin("data", path)
        return Origin("const", "a constant the step closes over")

    return origin


def _same_array(const: Any, leaf: np.ndarray) -> bool:
    try:
        array = np.asarray(const)
    except Exception:  # a key array, a tracer of an enclosing trace
        return False
    if np.shares_memory(array, leaf):  # the leaf or a view of it (a microbatch slice)
        return True
    return array.shape == leaf.shape and array.dtype == leaf.dtype and np.array_equal(array, leaf)
