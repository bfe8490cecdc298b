"""Bitwise mode vs default mode, per params layout, at the same shardings.

For each layout -- replicated params (data=8), FSDP over ``data`` (data=8), tensor
parallel (data=4, model=2) in Megatron's layout and with every matrix's last dimension
sharded (activations sharded on features: many collectives per layer) -- the same step (the test transformer's weighted token
loss with dropout, batch 64) runs in default mode and with ``bitwise=True`` (default
chunk size), side by side in alternating rounds. Reported per layout:

* step time, bitwise / default: median ratio with min and max (goal <= 1.15x on
  replicated and FSDP params), and the same rounds' process CPU time (all threads),
  bitwise / default: on cores shared with other jobs wall time also counts waiting
  for a core, CPU time counts the work;
* default mode cut into as many microbatches as a group has chunks, / default: the
  cost of running the same layout in programs of one chunk's rows (tensor parallel);
* the collectives XLA put in a chunk program (each runs once per chunk);
* the first call (trace, compile, run), bitwise / default (goal <= 3x): one-device groups
  share one compiled chunk program;
* bytes sent per device per step, bitwise / default, counted from the compiled HLO as
  ring algorithms send them (``unsplit.testing.bytes_sent``), and the bitwise combine's
  bytes over a ring all-reduce's ``2 (G - 1) / G`` of the same sums (goal <= 1.1x);
* per-device memory, bitwise / default (goal <= 1.3x). Default mode: XLA's memory
  analysis of its one program (arguments + outputs + temp). Bitwise mode: the peak a
  step holds, each buffer once (``unsplit.testing.bitwise_cost``);
* whether the bitwise result was bit-identical to the one-device bitwise result
  (replicated and FSDP layouts) or to the tensor-parallel result at data=1.

The simulated devices share this machine's cores, so the ratios show overheads, not
speed-ups; the table ends with the machine's load average over the run (other jobs on
the same cores make single rounds range widely: only the medians say anything). Run:
``python benchmarks/bitwise_bench.py`` (``--quick``: smaller, docs untouched).
"""

from __future__ import annotations

import dataclasses
import os

import common
import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding

import unsplit
import unsplit.testing
from unsplit.models import (
    Transformer,
    TransformerConfig,
    fsdp_specs,
    init_params,
    megatron_specs,
    on_mesh,
    synthetic_batch,
    tensor_parallel_specs,
    token_loss,
)

MARKER = "bitwise"
DOC = "benchmarks.md"
AUTO = (AxisType.Auto, AxisType.Auto)
CHUNK = 8  # bitwise mode's default chunk_size (docs/bitwise.md)


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    shape: tuple[int, int]
    specs: str  # "replicated", "fsdp" or "tp"


LAYOUTS = [
    Layout("replicated (data=8)", (8, 1), "replicated"),
    Layout("FSDP (data=8)", (8, 1), "fsdp"),
    Layout("tensor parallel, Megatron (data=4, model=2)", (4, 2), "megatron"),
    Layout("tensor parallel, every matrix's last dim (data=4, model=2)", (4, 2), "tp"),
]


def specs_for(layout: Layout, params):
    if layout.specs == "fsdp":
        return fsdp_specs(params, "data", 8)
    if layout.specs == "tp":
        return tensor_parallel_specs(params)
    if layout.specs == "megatron":
        return megatron_specs(params)
    return jax.tree.map(lambda _: jax.P(), params)


def measure(layout: Layout, config, batch, quick):
    model = Transformer(config)
    loss = token_loss(model)
    host = jax.tree.map(np.asarray, init_params(model))
    mesh = jax.make_mesh(layout.shape, ("data", "model"), axis_types=AUTO)
    params = on_mesh(host, mesh, specs_for(layout, host))
    rows = jax.device_put(batch, NamedSharding(mesh, jax.P("data")))
    key = jax.random.key(0)
    default = unsplit.value_and_grad(loss, weighted=True, mesh=mesh)
    bitwise = unsplit.value_and_grad(loss, weighted=True, mesh=mesh, bitwise=True)
    # First calls (trace + compile + run), default mode first: the jit caches are cold for both.
    first = {name: common.time_once(lambda s=s: s(params, rows, key))
             for name, s in (("default", default), ("bitwise", bitwise))}  # fmt: skip
    candidates = {
        "default": lambda: default(params, rows, key),
        "bitwise": lambda: bitwise(params, rows, key),
    }
    # Chunks per data-parallel group: default mode cut into as many microbatches runs
    # programs of one chunk's rows per group, as the bitwise chunk programs do.
    per_group = len(batch["inputs"]) // (CHUNK * layout.shape[0])
    if per_group > 1:
        chunked = unsplit.value_and_grad(loss, weighted=True, mesh=mesh, microbatches=per_group)
        candidates["chunked"] = lambda: chunked(params, rows, key)
    timing = common.compare(
        candidates,
        baseline="default",
        repeats=3 if quick else 15,
        inner=1,
    )
    out = bitwise(params, rows, key)
    cost = unsplit.testing.bitwise_cost(bitwise, params, rows, key)
    one = None
    if layout.specs in ("tp", "megatron"):
        one = jax.make_mesh((1, 2), ("data", "model"), axis_types=AUTO)
        ref_params = on_mesh(host, one, specs_for(layout, host))
    else:
        ref_params = host
    ref = unsplit.value_and_grad(loss, weighted=True, mesh=one, bitwise=True)(
        ref_params, batch, key
    )
    default_compiled = default.lower(params, rows, key).compile()
    mem_default = common.compiled_bytes(default_compiled)
    timing = {r.name: r for r in timing}
    return {
        "layout": layout.name,
        "time": timing["bitwise"],
        "first": first["bitwise"] / first["default"],
        "chunked": (per_group, timing.get("chunked")),
        "memory": (cost.memory_per_device, mem_default),
        "identical": unsplit.testing.bits_equal(out, ref),
        "collectives": cost.chunk_collectives,
        "bytes": (
            cost.bytes_sent_per_device,
            unsplit.testing.bytes_sent(default_compiled),
            cost.combine_vs_ring,
        ),
    }


def bytes_cell(bitwise: float, default: float, _) -> str:
    ratio = common.times_cell(common.ratio(bitwise, default))
    return f"{bitwise / 2**20:.2f} / {default / 2**20:.2f} MiB ({ratio})"


def chunked_cell(per_group: int, result) -> str:
    if result is None:
        return "- (one chunk per group)"
    return f"{common.ratio_cell(result)} (microbatches={per_group})"


def main() -> None:
    args = common.bench_parser(__doc__).parse_args()
    config = TransformerConfig(vocab=64, length=32, width=64, heads=4, layers=2)
    if args.quick:
        config = TransformerConfig(vocab=32, length=16, width=32, heads=2, layers=1)
    batch = jax.tree.map(np.asarray, synthetic_batch(config, 64, seed=1))
    load = os.getloadavg()[0]
    rows = [measure(layout, config, batch, args.quick) for layout in LAYOUTS]
    load = (load + os.getloadavg()[0]) / 2
    header = ["layout", "step time: bitwise / default (median, min-max)",
              "process CPU time: bitwise / default (median)",
              "default mode in one-chunk programs (microbatches = chunks per group) / default",
              "collectives per chunk program", "first call: bitwise / default",
              "memory per device: bitwise / default",
              "bytes sent per device per step: bitwise / default",
              "combine's bytes / a ring all-reduce's", "bit-identical to its reference"]  # fmt: skip
    cells = []
    for r in rows:
        t, (mb, md) = r["time"], r["memory"]
        cells.append(
            [
                r["layout"],
                common.ratio_cell(t),
                common.times_cell(t.cpu_ratio_median),
                chunked_cell(*r["chunked"]),
                str(r["collectives"]),
                f"{r['first']:.1f}x",
                f"{mb / 2**20:.1f} / {md / 2**20:.1f} MiB "
                f"({common.times_cell(common.ratio(mb, md))})",
                bytes_cell(*r["bytes"]),
                f"{r['bytes'][2]:.2f}x",
                "yes" if r["identical"] else "NO",
            ]
        )
    title = "bitwise / default mode, same shardings (batch 64, default chunk size 8)"
    common.print_table(title, header, cells)
    if common.should_write(args):
        body = common.markdown_table(header, cells)
        loaded = f"Load average (1 min, mean of the run's start and end): {load:.1f}."
        common.write_table(DOC, MARKER, f"{body}\n\n{loaded}")


if __name__ == "__main__":
    main()
