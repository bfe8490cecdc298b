"""The ``batch_draw`` findings: which draws make an example's noise its row of one array.

:mod:`unsplit._src.audit.batched` traces a step and walks it; this module turns the
draws it saw into findings, one per key and loop situation, with the message that
says how the noise depends on the schedule. Three signals:

* the doubled batch (:func:`doubling_groups`): a draw whose shape follows the batch
  size while its key's does not, or a loop over microbatches (more iterations for a
  larger batch) drawing from one key per iteration;
* where noise meets the batch's rows (:func:`row_draw_findings`,
  :mod:`unsplit._src.audit.rows`): a loop whose size is a constant of the code;
* microbatches stacked on the batch's leading axis (:func:`stacked_draw_findings`):
  a batch shaped ``(K, microbatch, ...)`` run by a Python ``for`` loop of ``K``
  iterations (unrolled by the trace), each drawing over its whole microbatch from
  its own key (``jax.random.split(key, K)[i]``), as Flax trainers accumulate.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from unsplit._src.audit.finding import AuditWarning, Finding, finding, traced_sites
from unsplit._src.audit.graph import Walker, roots
from unsplit._src.audit.keys import Draw
from unsplit._src.audit.rows import Meeting, RowRules, draw_tag


def doubling_groups(draws: Sequence[Draw], larger: Sequence[Draw]) -> dict[tuple, list[Draw]]:
    """The draws whose shape follows the batch size while their key's shape does not, one
    group per key and loop situation."""
    if len(draws) != len(larger):
        warnings.warn(
            f"unsplit.audit_step: batch_draw was checked only where noise meets the batch's "
            f"rows: the step draws {len(draws)} times with this batch and {len(larger)} times "
            "with a batch twice as large.",
            AuditWarning,
            stacklevel=4,
        )
        return {}
    groups: dict[tuple, list[Draw]] = {}  # one finding per key and loop situation
    for d, e in zip(draws, larger, strict=True):
        if d.shape != e.shape and d.key_shapes == e.key_shapes:
            groups.setdefault((roots(d.key_info), _same_key_in_loop(d)), []).append(d)
        elif _one_key_per_microbatch(d, e):
            groups.setdefault((roots(d.key_info), "per microbatch"), []).append(d)
    return groups


def group_findings(groups: dict[tuple, list[Draw]], meetings: dict | None = None) -> list:
    out = []
    for group in groups.values():
        sites = list(dict.fromkeys(d.site for d in group))
        others = sites[1:]  # every other line, however many: none is left out
        also = (
            f" The same key also draws at {len(others)} other line"
            f"{'s' if len(others) > 1 else ''}: {', '.join(map(str, others))}."
            if others
            else ""
        )
        first = group[0]
        message = (
            _batch_draw_message(first)
            if meetings is None
            else _row_draw_message(first, meetings[draw_tag(first.ctx, first.eqn)])
        )
        out.append(finding("batch_draw", message + _called_from(first) + also, first.site))
    return out


def _called_from(d: Draw) -> str:
    """Where the traced step calls the code that draws (a Flax layer's ``model.apply``
    line), when the draw's line is inside another function: both lines are the user's."""
    sites = traced_sites(d.eqn) or d.ctx.callers
    if len(sites) < 2 or sites[1].function == sites[0].function:
        return ""
    return f" It is drawn inside the call at {sites[1]} (in {sites[1].function})."


def stacked_draw_findings(
    traced: Any, argnums: Sequence[int], infos: list, consts: Any, seen: set
) -> list[Finding]:
    """Draws from one key per microbatch over microbatches stacked on the batch's leading
    axis, ``(K, microbatch, ...)``, run by a Python loop of ``K`` iterations (the trace
    unrolls it: the same line draws ``K`` times); ``seen``: the tags already reported.

    The doubled batch misses them (``K`` is a constant of the code, so a larger batch
    draws the same shapes) and so do the batch's rows (indexing ``batch[i]`` takes the
    leading axis away): here both leading axes index rows, as for a ``jax.pmap``.
    """
    batch = [leaf for leaf in traced.leaves if leaf.arg in argnums]
    sizes = {leaf.aval.shape[0] if leaf.aval.ndim >= 2 else None for leaf in batch}
    if len(sizes) != 1 or None in sizes or sizes == {1}:
        return []
    (count,) = sizes
    in_rows = [frozenset({0, 1} if leaf.arg in argnums else ()) for leaf in traced.leaves]
    rules = RowRules(in_rows)
    Walker(rules).run(traced.closed, infos, consts)
    draws = [d for d in rules.draws_of() if not d.ctx.loops]
    per_site = collections.Counter(d.site for d in draws)
    groups: dict[Any, list[Draw]] = {}
    for d in draws:
        tag = draw_tag(d.ctx, d.eqn)
        repeated = per_site[d.site] == count and tag not in seen
        if repeated and tag in rules.meetings and _one_key_here(d):
            groups.setdefault((roots(d.key_info), d.site), []).append(d)
    out = []
    for group in groups.values():
        d = group[0]
        meeting = rules.meetings[draw_tag(d.ctx, d.eqn)]
        message = (
            f"one key per microbatch draws noise of shape {d.shape} over its whole "
            f"microbatch: the batch holds {count} microbatches stacked on its leading axis, "
            f"and the loop that runs them (unrolled: this line draws {count} times) gives "
            f"each its own key (split or folded per microbatch); at {meeting.site} an axis "
            f"of the noise (of length {meeting.size}) meets the microbatch's rows "
            f"({meeting.rows}): an example's noise is the row of one array at its position "
            "in its microbatch, so it changes with the number of microbatches and how the "
            "batch is cut, not a function of the example. Fix: per-example keys, "
            "unsplit.example_keys(key, ids), or unsplit.value_and_grad(loss_fn, "
            "microbatches=k)."
        )
        out.append(finding("batch_draw", message + _called_from(d), d.site))
    return out


def row_draw_findings(
    draws: Sequence[Draw], meetings: dict[tuple, Meeting], flagged: dict[tuple, list[Draw]]
) -> list[Finding]:
    """Draws from one key (per iteration) whose own axis meets an axis of the batch's rows;
    draws the doubled batch already ``flagged`` are not repeated."""
    seen = {draw_tag(d.ctx, d.eqn) for group in flagged.values() for d in group}
    groups: dict[tuple, list[Draw]] = {}
    for d in draws:
        tag = draw_tag(d.ctx, d.eqn)
        if tag in meetings and tag not in seen and _one_key_here(d):
            groups.setdefault((roots(d.key_info), _same_key_in_loop(d)), []).append(d)
    return group_findings(groups, meetings)


def _one_key_here(d: Draw) -> bool:
    """Whether the draw uses one key where it runs (its operands' own shapes: inside a loop
    body, a per-example key array of the microbatch keeps its leading axis)."""
    single = ((), (2,)) if d.key_dtype == "uint32" else ((),)
    operands = d.eqn.invars[: len(d.key_shapes)]
    return all(tuple(getattr(v.aval, "shape", ())) in single for v in operands)


def _row_draw_message(d: Draw, meeting: Meeting) -> str:
    text = (
        f"one key draws noise of shape {d.shape}, and at {meeting.site} an axis of it (of "
        f"length {meeting.size}) meets the rows of the batch ({meeting.rows}): an example's "
        "noise is the row of one array at the example's position, not a function of the example"
    )
    if _same_key_in_loop(d):
        return (
            f"{text}. Inside the loop at {d.ctx.loops[-1].marker.site} the key is the same at "
            "every iteration, so every microbatch gets the same noise."
        )
    if d.ctx.loops:
        return (
            f"{text}. The loop at {d.ctx.loops[-1].marker.site} draws each iteration's noise "
            "from one key (split or folded per microbatch): an example's noise depends on which "
            "microbatch it lands in and where, so it changes with the number of microbatches "
            "(even when their size is a constant of the code). Fix: per-example keys, "
            "unsplit.example_keys(key, ids), or unsplit.value_and_grad."
        )
    if d.ctx.device_maps:
        return f"{text}. Inside shard_map/pmap each device draws for its own share."
    return f"{text}; it changes with the batch size and with how the batch is cut."


def _trips(d: Draw) -> int:
    """How many times the draw runs: the product of its enclosing scans' lengths."""
    return int(np.prod([loop.eqn.params.get("length", 1) for loop in d.ctx.loops]))


def _iteration_key_shapes(d: Draw) -> tuple[tuple[int, ...], ...]:
    """The key's shape in one iteration: a key array the loop scans over loses its leading
    (per-iteration) axis."""
    trips = _trips(d)
    return tuple(s[1:] if s and s[0] == trips else s for s in d.key_shapes)


def _single_key(d: Draw) -> bool:
    single = ((), (2,)) if d.key_dtype == "uint32" else ((),)
    return all(s in single for s in _iteration_key_shapes(d))


def _one_key_per_microbatch(d: Draw, larger: Draw) -> bool:
    """A loop over microbatches (more iterations for a larger batch) in which one key draws
    a non-scalar array each iteration: noise for a whole microbatch from one key."""
    return (
        bool(d.ctx.loops)
        and d.shape == larger.shape
        and bool(d.shape)
        and _iteration_key_shapes(d) == _iteration_key_shapes(larger)
        and _single_key(d)
        and _trips(larger) > _trips(d)
    )


def _same_key_in_loop(d: Draw) -> bool:
    return bool(d.ctx.loops) and d.ctx.loops[-1].marker not in d.key_info


def _batch_draw_message(d: Draw) -> str:
    text = (
        f"one key draws noise of shape {d.shape} for a whole (micro)batch: an example's "
        "noise is its row of one array, so it depends on the example's position and on the "
        "batch size, not on the example"
    )
    if d.ctx.loops and _trips(d) > 1 and not _same_key_in_loop(d):
        return (
            f"{text}. The loop at {d.ctx.loops[-1].marker.site} runs once per microbatch "
            "(more often for a larger batch) and each iteration draws from one key (split or "
            "folded per microbatch, as Levanter's and MaxText's accumulation loops do): an "
            "example's noise depends on which microbatch it lands in and where, so it changes "
            "with the microbatch size. Fix: per-example keys, unsplit.example_keys(key, ids), "
            "or unsplit.value_and_grad."
        )
    if _same_key_in_loop(d):
        return (
            f"{text}. Inside the loop at {d.ctx.loops[-1].marker.site} the key is the same at "
            "every iteration, so every microbatch gets the same noise (T5X's microbatching "
            "does this)."
        )
    if d.ctx.device_maps:
        return f"{text}. Inside shard_map/pmap each device draws for its own share."
    return f"{text}."
