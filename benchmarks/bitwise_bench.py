"""Bitwise mode vs default mode, per params layout, at the same shardings.

For each layout -- replicated params (data=8), FSDP over ``data`` (data=8), tensor
parallel (data=4, model=2) in Megatron's layout and with every matrix's last dimension
sharded (activations sharded on features: many collectives per layer) -- the same step (the test transformer's weighted token
loss with dropout, batch 64) runs in default mode and with ``bitwise=True`` (default
chunk size), side by side in alternating rounds. Reported per layout:

* step time, bitwise / default: median ratio with min and max (goal <= 1.10x);
* default mode cut into as many microbatches as a group has chunks, / default: the
  cost of running the same layout in programs of one chunk's rows (tensor parallel);
* the collectives XLA put in a chunk program (each runs once per chunk);
* the first call (trace, compile, run), bitwise / default (goal <= 3x): one-device groups
  share one compiled chunk program;
* bytes sent per device per step, bitwise / default, counted from the compiled HLO as
  ring algorithms send them (``unsplit.testing.bytes_sent``), and the bitwise combine's
  bytes over a ring all-reduce's ``2 (G - 1) / G`` of the same sums (goal <= 1.1x);
* per-device memory, bitwise / default (goal <= 1.25x). Default mode: XLA's memory
  analysis of its one program (arguments + outputs + temp). Bitwise mode: the peak a
  step holds, each buffer once (see ``bitwise_memory``);
* whether the bitwise result was bit-identical to the one-device bitwise result
  (replicated and FSDP layouts) or to the tensor-parallel result at data=1.

The simulated devices share this machine's cores, so the ratios show overheads, not
speed-ups. Run: ``python benchmarks/bitwise_bench.py`` (``--quick``: smaller, docs
untouched).
"""

from __future__ import annotations

import dataclasses
import re

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


def memory(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def per_device_bytes(tree) -> int:
    leaves = jax.tree.leaves(tree)
    return sum(x.addressable_shards[0].data.nbytes for x in leaves)


def bitwise_memory(step, params, rows, key) -> int:
    """The peak bytes a bitwise step holds per device, each buffer counted once.

    Held through the step: the params the caller holds, the flat params the pack
    program makes (one copy per device: it is an argument of every chunk program)
    and the partial sums of every chunk of a group (all dispatched at once). On top
    of that, the largest of: a chunk program's other arguments (one chunk of rows,
    the key, the ids) and its temp; the combine program (the stacked blocks, the
    total, temp); the unpack program (the total, the grads, temp).
    """
    (state,) = step._impl._plans.values()
    plan = state.plan
    flat = sum(v.addressable_shards[0].data.nbytes for v in state.pack(params))
    chunk = max(state.executables.values(), key=memory).memory_analysis()
    sums = chunk.output_size_in_bytes
    chunk_rest = chunk.argument_size_in_bytes - flat + chunk.temp_size_in_bytes
    combine = state.combine_compiled()
    totals = [
        jax.ShapeDtypeStruct((n * plan.group_size,), dt, sharding=state.total_sharding)
        for n, dt in zip(plan.sums_flat.lengths, plan.sums_flat.vectors, strict=True)
    ]
    unpack = state.unpack.lower(totals).compile()
    peak = max(chunk_rest, memory(combine), memory(unpack))
    return per_device_bytes(params) + flat + plan.per_group * sums + peak


def bytes_sent(step, params, default_compiled) -> tuple[float, float, float]:
    """Bytes sent per device per step, from the compiled HLO (ring accounting).

    Returns (bitwise: pack + a group's chunk programs + combine, default mode's
    program, the combine / a ring all-reduce of the same sums: ``2 (G - 1) / G`` of
    them).
    """
    (state,) = step.engine._plans.values()
    plan = state.plan
    combine = unsplit.testing.bytes_sent(state.combine_compiled())
    pack = unsplit.testing.bytes_sent(state.pack.lower(params).compile())
    chunk = max(unsplit.testing.bytes_sent(c.as_text()) for c in state.executables.values())
    pack += plan.per_group * chunk
    sums = sum(
        n * np.dtype(d).itemsize
        for n, d in zip(plan.sums_flat.lengths, plan.sums_flat.vectors, strict=True)
    )
    ring = 2 * (plan.groups - 1) / plan.groups * sums
    return pack + combine, unsplit.testing.bytes_sent(default_compiled), combine / ring


def collectives(step) -> int:
    """Collective ops (all-reduce, all-gather, ...) in the largest chunk program."""
    (state,) = step._impl._plans.values()
    kinds = "all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all"
    return max(
        len(re.findall(rf"= \S+ ({kinds})\(", c.as_text())) for c in state.executables.values()
    )


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
    mem_default = memory(default_compiled)
    timing = {r.name: r for r in timing}
    return {
        "layout": layout.name,
        "time": timing["bitwise"],
        "first": first["bitwise"] / first["default"],
        "chunked": (per_group, timing.get("chunked")),
        "memory": (bitwise_memory(bitwise, params, rows, key), mem_default),
        "identical": unsplit.testing.bits_equal(out, ref),
        "collectives": collectives(bitwise),
        "bytes": bytes_sent(bitwise, params, default_compiled),
    }


def bytes_cell(bitwise: float, default: float, _) -> str:
    return f"{bitwise / 2**20:.2f} / {default / 2**20:.2f} MiB ({bitwise / default:.2f}x)"


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
    rows = [measure(layout, config, batch, args.quick) for layout in LAYOUTS]
    header = ["layout", "step time: bitwise / default (median, min-max)",
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
                chunked_cell(*r["chunked"]),
                str(r["collectives"]),
                f"{r['first']:.1f}x",
                f"{mb / 2**20:.1f} / {md / 2**20:.1f} MiB ({mb / md:.2f}x)",
                bytes_cell(*r["bytes"]),
                f"{r['bytes'][2]:.2f}x",
                "yes" if r["identical"] else "NO",
            ]
        )
    title = "bitwise / default mode, same shardings (batch 64, default chunk size 8)"
    common.print_table(title, header, cells)
    if common.should_write(args):
        common.write_table(DOC, MARKER, common.markdown_table(header, cells))


if __name__ == "__main__":
    main()
