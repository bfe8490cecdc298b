"""Per-device memory and bytes sent of a 4-D layout at model scale, from the implementation.

The layout is ``(data, fsdp, seq, model)``: params sharded over ``fsdp`` and
``model`` (FSDP + tensor parallel), the batch over ``data`` and ``fsdp``, each
example's activations over ``seq``. In bitwise mode with ``chunk_axes="fsdp"``
the group is ``fsdp x seq x model`` (``F·S·M`` devices, across hosts when that is
more than a host's devices) and there are ``data`` groups. Each term is what
the implementation allocates or sends, per device, as
:func:`unsplit.testing.bitwise_cost` reads it from the compiled programs
(``scale_test.py`` checks the terms against it on 8 devices):

* params held, and the flat params the chunk program reads: ``4P / (F·M)`` each;
* partial sums: ``_held_sums`` (the canonical tree's most live chunk sums, the
  same function ``bitwise_cost`` uses) times one device's sums, ``4P / (F·M)``;
* the params gathered whole over ``fsdp`` for the group's chunk programs (once a
  step, let go before the combine): ``4P / M``;
* the combine: its stacked blocks, the pieces the ``all_to_all`` brings and the
  total, about ``3 · 4P / (F·M)`` for a group whose chunks are one aligned block;
  the step's peak holds the larger of it and the gathered params;
* ``train_step``'s Adam update on each group's shards: ``16P / (F·M)``;
* bytes sent: the group's all-gather of the params over ``fsdp``, once a step
  (``4P/M · (F−1)/F``), and per chunk its reduce-scatter of the grads (the same
  bytes), times the group's chunks; the combine, a ring all-reduce's
  ``2 · 4P/(F·M) · (D−1)/D``.

Activations (one chunk's, split over ``fsdp`` rows and ``seq`` positions) and the
tensor- and sequence-parallel collectives on them depend on the model, not on
``P``: they are not in these figures.

Example:
    >>> row = bitwise_step(7e9, Layout(data=4, fsdp=4, seq=2, model=8), chunks=32)
    >>> round(row["params"] / 1e9, 3), round(row["sent"] / 1e9, 1)
    (0.875, 24.9)
"""

from __future__ import annotations

import dataclasses

from unsplit._src.bitwise.cost import _held_sums

F32 = 4


@dataclasses.dataclass(frozen=True)
class Layout:
    """A ``(data, fsdp, seq, model)`` mesh's sizes."""

    data: int
    fsdp: int
    seq: int
    model: int

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.seq * self.model

    @property
    def group(self) -> int:
        return self.fsdp * self.seq * self.model


def bitwise_step(params: float, layout: Layout, chunks: int) -> dict[str, float]:
    """Bytes per device of a bitwise step (``chunk_axes="fsdp"``), ``chunks`` in the batch."""
    shard = F32 * params / (layout.fsdp * layout.model)
    per_group = chunks // layout.data
    partial = _held_sums(0, per_group) * shard
    combine = 3 * shard
    f, d = layout.fsdp, layout.data
    inside = (1 + per_group) * F32 * params / layout.model * (f - 1) / f  # 1 gather, c scatters
    across = 2 * shard * (d - 1) / d
    gathered = F32 * params / layout.model
    return {
        "params": shard,
        "gathered": gathered,
        "step": shard + shard + partial + max(gathered, combine),
        "update": 4 * shard,
        "sent": inside + across,
    }


def default_step(params: float, layout: Layout) -> dict[str, float]:
    """Bytes per device of default mode on the same layout (one gather and scatter a step)."""
    shard = F32 * params / (layout.fsdp * layout.model)
    f, d = layout.fsdp, layout.data
    return {
        "params": shard,
        "step": 2 * shard,  # params and grads
        "update": 4 * shard,
        "sent": 2 * F32 * params / layout.model * (f - 1) / f + 2 * shard * (d - 1) / d,
    }


# The table of the Bitwise mode guide ("At model scale"): a host has 8 devices, the model axis
# is a host's, the sequence degree 2; the fsdp degree grows with the model (the group of
# fsdp x seq x model devices spans hosts), and each group runs 4 chunks per step.
MODELS = (("7B", 7e9, 4), ("70B", 70e9, 16))
DEVICES = (64, 256, 1024)
CHUNKS_PER_GROUP = 4


def rows() -> list[tuple[str, int, Layout, dict, dict]]:
    out = []
    for name, params, fsdp in MODELS:
        for devices in DEVICES:
            f = min(fsdp, devices // 16)
            layout = Layout(data=devices // (f * 16), fsdp=f, seq=2, model=8)
            chunks = CHUNKS_PER_GROUP * layout.data
            out.append(
                (name, devices, layout, bitwise_step(params, layout, chunks),
                 default_step(params, layout))
            )  # fmt: skip
    return out


def table() -> str:
    """The markdown table the Bitwise mode guide quotes (``python -m unsplit._src.bitwise.scale``)."""
    head = (
        "| model | devices | (data, fsdp, seq, model); group | params held | bitwise step "
        "(params + flat + partial sums + the larger of the params gathered over fsdp and the "
        "combine) / default (params + grads) | Adam update "
        "(both) | bytes sent per device per step, bitwise / default |\n"
        "|---|---|---|---|---|---|---|\n"
    )

    def gb(x: float) -> str:
        return f"{x / 1e9:.2f} GB"

    lines = [
        f"| {name} | {n:,}".replace(",", " ")
        + f" | ({lay.data}, {lay.fsdp}, {lay.seq}, {lay.model}); {lay.group} | "
        f"{gb(b['params'])} | {gb(b['step'])} / {gb(d['step'])} | {gb(b['update'])} | "
        f"{b['sent'] / 1e9:.1f} GB / {d['sent'] / 1e9:.1f} GB |"
        for name, n, lay, b, d in rows()
    ]
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table())
