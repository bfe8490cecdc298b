"""The demo's result rows: each run compared with its reference, as JSON-ready dicts.

:func:`compare` measures how far two runs' parameters are apart at every
snapshot; the ``*_row`` functions turn runs into the rows that
:mod:`~unsplit.demo.report` prints and plots (the demo guide: https://unsplit.readthedocs.io/en/latest/demo/).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from unsplit.demo import resume as demo_resume
from unsplit.demo import train as dt

BASELINE = "flax baseline"  # flax's batch-level dropout, the whole batch on 1 device


def inert_leaves(params: Any) -> list[str]:
    """Paths of the attention key biases: parameters that cannot change the model's output.

    A key bias adds the same ``q . b`` to every attention logit of a query, and
    softmax ignores such a shift, so its gradient is 0 up to rounding. Adam
    rescales that rounding noise into full-size steps, in every run alike, so
    these values drift apart between *any* two runs and say nothing about the
    schedule; :func:`compare` leaves them out of ``max_abs_param_diff``.
    """
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return [p for p in paths if p.endswith("['key']['bias']")]


def compare(snapshots: dict, reference: dict, skip: frozenset[int] | set[int] = frozenset()):
    """Max |param difference| at every snapshot step (leaves in ``skip`` left out).

    Returns:
        ``(curve, max_all, bit_identical)``: ``[[step, max diff], ...]``, the
        last step's max diff over every leaf, and whether every leaf is
        bit-identical at the last step.
    """

    def diffs(step):
        return [
            float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))
            for a, b in zip(snapshots[step], reference[step], strict=True)
        ]

    curve = [
        [step, max(d for i, d in enumerate(diffs(step)) if i not in skip)]
        for step in sorted(snapshots)
    ]
    last = max(snapshots)
    same = all(
        a.dtype == b.dtype and a.tobytes() == b.tobytes()
        for a, b in zip(snapshots[last], reference[last], strict=True)
    )
    return curve, max(diffs(last)), same


def contrast_row(row: Callable, c: Any) -> dict[str, Any]:
    return row(
        c.name, c.compared_with, scheme=c.scheme, devices=c.devices, microbatches=c.microbatches
    )


def schedule_rows(row: Callable, plan: Any, elastic_info: dict | None, steps: int) -> list[dict]:
    """The schedules' rows, default mode first, then bitwise mode and the elastic row."""
    rows = [
        row(s.name, s.reference, devices=s.devices, processes=s.processes,
            microbatches=s.microbatches, bitwise=s.bitwise)
        for s in [*plan.local, *plan.remote]
    ]  # fmt: skip
    rows.sort(key=lambda r: r["bitwise"])  # stable: in the order of schedules()
    if elastic_info is not None:
        second = demo_resume.SECOND
        rows.append(
            row(demo_resume.name(steps), "reference, bitwise",
                devices=second["devices"] * second["processes"], processes=second["processes"],
                microbatches=second["microbatches"], bitwise=True, **elastic_info)
        )  # fmt: skip
    return rows


def result_row(
    name: str, r: dt.Run, reference: dt.Run, against: str, skip: set[int], **fields
) -> dict[str, Any]:
    """One row of the table and the JSON: ``r`` compared with the run named ``against``."""
    curve, all_diff, same = compare(r.snapshots, reference.snapshots, skip)
    return {
        "name": name,
        **fields,
        "final_loss": float(r.losses[-1]),
        "max_abs_param_diff": curve[-1][1],
        "max_abs_param_diff_all": all_diff,
        "bit_identical": same,
        "step_time_s": r.step_time_s,
        "wall_s": r.wall_s,
        "compared_with": against,
        "losses": r.losses.tolist(),
        "divergence": curve,
    }


def baseline_row(base: dt.Run) -> dict[str, Any]:
    return {
        "name": BASELINE,
        "scheme": "one_device",
        "final_loss": float(base.losses[-1]),
        "step_time_s": base.step_time_s,
        "wall_s": base.wall_s,
        "losses": base.losses.tolist(),
    }


def environment() -> dict[str, Any]:
    return {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
    }
