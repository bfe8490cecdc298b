"""Bitwise mode vs default mode, per params layout, at the same shardings.

For each layout -- replicated params (data=8), FSDP over ``data`` (data=8), tensor
parallel (data=4, model=2) -- the same step (the test transformer's weighted token
loss with dropout, batch 64) runs in default mode and with ``bitwise=True`` (default
chunk size), side by side in alternating rounds. Reported per layout:

* step time, bitwise / default: median ratio with min and max (goal <= 1.10x);
* per-device memory, bitwise / default (goal <= 1.25x). Default mode: XLA's memory
  analysis of its one program (arguments + outputs + temp). Bitwise mode: the params
  the caller holds, plus the largest program a device runs (its group's chunk program:
  flat params, the group's rows, partial sums, temp), plus the flat params the pack
  program leaves behind;
* whether the bitwise result was bit-identical to the one-device bitwise result
  (replicated and FSDP layouts) or to the tensor-parallel result at data=1.

The simulated devices share this machine's cores, so the ratios show overheads, not
speed-ups. Run: ``python benchmarks/bitwise_bench.py`` (``--quick``: smaller, docs
untouched).
"""

from __future__ import annotations

import dataclasses

import common
import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from rich.console import Console
from rich.table import Table

import unsplit
from unsplit._src import test_util
from unsplit.models import Transformer, TransformerConfig, init_params, synthetic_batch, token_loss

MARKER = "bitwise"
DOC = "benchmarks.md"
AUTO = (AxisType.Auto, AxisType.Auto)


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    shape: tuple[int, int]
    specs: str  # "replicated", "fsdp" or "tp"


LAYOUTS = [
    Layout("replicated (data=8)", (8, 1), "replicated"),
    Layout("FSDP (data=8)", (8, 1), "fsdp"),
    Layout("tensor parallel (data=4, model=2)", (4, 2), "tp"),
]


def specs_for(layout: Layout, params):
    if layout.specs == "fsdp":
        return test_util.fsdp_specs(params, "data", 8)
    if layout.specs == "tp":
        return test_util.tensor_parallel_specs(params)
    return jax.tree.map(lambda _: jax.P(), params)


def memory(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def per_device_bytes(tree) -> int:
    leaves = jax.tree.leaves(tree)
    return sum(x.addressable_shards[0].data.nbytes for x in leaves)


def bitwise_memory(step, params) -> int:
    """Params held + the largest chunk program + the packed params (per device)."""
    (state,) = step._impl._plans.values()
    chunk = max(memory(c) for c in state.executables.values())
    flat = sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize // state.plan.layout.mesh.size
        for v in state.pack(params)
    )
    return per_device_bytes(params) + chunk + flat


def measure(layout: Layout, config, batch, quick):
    model = Transformer(config)
    loss = token_loss(model)
    host = jax.tree.map(np.asarray, init_params(model))
    mesh = jax.make_mesh(layout.shape, ("data", "model"), axis_types=AUTO)
    params = test_util.replicated(host, mesh, specs_for(layout, host))
    rows = jax.device_put(batch, NamedSharding(mesh, jax.P("data")))
    key = jax.random.key(0)
    default = unsplit.value_and_grad(loss, weighted=True, mesh=mesh)
    bitwise = unsplit.value_and_grad(loss, weighted=True, mesh=mesh, bitwise=True)
    timing = common.compare(
        {
            "default": lambda: default(params, rows, key),
            "bitwise": lambda: bitwise(params, rows, key),
        },
        baseline="default",
        repeats=3 if quick else 15,
        inner=1,
    )
    out = bitwise(params, rows, key)
    one = mesh if layout.specs == "tp" else None
    if layout.specs == "tp":
        one = jax.make_mesh((1, 2), ("data", "model"), axis_types=AUTO)
        ref_params = test_util.replicated(host, one, specs_for(layout, host))
    else:
        ref_params = host
    ref = unsplit.value_and_grad(loss, weighted=True, mesh=one, bitwise=True)(
        ref_params, batch, key
    )
    mem_default = memory(default.lower(params, rows, key).compile())
    return {
        "layout": layout.name,
        "time": {r.name: r for r in timing}["bitwise"],
        "memory": (bitwise_memory(bitwise, params), mem_default),
        "identical": test_util.bits_equal(out, ref),
    }


def main() -> None:
    args = common.bench_parser(__doc__).parse_args()
    config = TransformerConfig(vocab=64, length=32, width=64, heads=4, layers=2)
    if args.quick:
        config = TransformerConfig(vocab=32, length=16, width=32, heads=2, layers=1)
    batch = jax.tree.map(np.asarray, synthetic_batch(config, 64, seed=1))
    rows = [measure(layout, config, batch, args.quick) for layout in LAYOUTS]
    table = Table(title="bitwise / default mode, same shardings (batch 64, default chunk size 8)")
    header = ["layout", "step time: bitwise / default (median, min-max)",
              "memory per device: bitwise / default", "bit-identical to its reference"]  # fmt: skip
    for h in header:
        table.add_column(h)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        t, (mb, md) = r["time"], r["memory"]
        cells = [
            r["layout"],
            f"{t.ratio_median:.2f}x ({t.ratio_min:.2f}-{t.ratio_max:.2f})",
            f"{mb / 2**20:.1f} / {md / 2**20:.1f} MiB ({mb / md:.2f}x)",
            "yes" if r["identical"] else "NO",
        ]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console().print(table)
    if common.should_write(args):
        common.write_table(DOC, MARKER, "\n".join(lines))


if __name__ == "__main__":
    main()
