"""FSDP groups (``chunk_axes``): bitwise mode's per-device memory vs default mode's.

A params-dominated model (an 8-layer MLP, 2048 wide: 33.6M params, 128 MiB in
f32, with dropout) on a (data=2, fsdp=4) mesh, params sharded over ``fsdp``, the
batch (32 rows) over ``("data", "fsdp")``. The same step runs in default mode,
in bitwise mode with ``chunk_axes="fsdp"`` (each group of 4 devices computes
each chunk together, params kept sharded) and in bitwise mode without it
(params gathered whole on every device). Reported per mode:

* per-device memory from XLA's compiled memory analysis: default mode's one
  program (arguments + outputs + temp); bitwise mode's peak as
  ``unsplit.testing.bitwise_cost`` counts it (the params held, the flat params,
  the partial sums the canonical tree holds, plus the largest of a chunk
  program's other arguments and temp, the combine and the unpack);
* the process's peak resident memory during the first step (8 simulated devices
  in one process, so all 8 devices' buffers and the compiler's), each mode in a
  process of its own, above the same baseline (params and batch placed);
* the same for an AdamW train step (``unsplit.train_step``; default mode's is one
  jitted program), above the params and the optimizer state: with ``chunk_axes``
  the update runs on each group's shards; without, whole on one device;
* whether the loss and grads are bit-identical to the (data=1, fsdp=4) run.

Goal (issue 20): bitwise with ``chunk_axes`` <= 1.5x default mode's per-device
memory. Run: ``python benchmarks/fsdp_groups_bench.py`` (``--quick``: a smaller
model, docs untouched).

``--reduce`` (issue 27, item 2) compares, in one process and side by side, the FSDP
groups' in-group sum as unsplit adds it (a fixed-order reduce-scatter: an
``all_to_all`` of pieces, the canonical tree over the group's devices) with XLA's
reduce-scatter (unsplit's old path, turned on for the steps it builds by the
library's measuring switch ``UNSPLIT_BENCH_XLA_GROUP_REDUCE=1``): bytes each device
sends per chunk program and per step (``unsplit.testing.bitwise_cost``, ring
accounting), the step time ratio (alternating rounds, median and min-max) and
whether each is bit-identical to the data=1 run.

``--update`` does the same for a whole ``train_step`` (``clip_by_global_norm`` +
AdamW, the update on each group's shards): every sum across a group -- the chunk
programs' and the update's (the global norm: manual over the group, the partials
all-gathered and added in the canonical tree) -- as unsplit adds them vs XLA's
collectives (the same switch, which covers both): the train step's time ratio and
whether 3 steps end in the data=1 run's bits.

``--transformer`` (issue 37, item 7) times the same train step (``clip_by_global_norm`` +
AdamW, the state sharded like the params) on the tiny Transformer
(``unsplit.models.Transformer`` at its default sizes, 110k params, token-weighted loss,
batch 64) with ``unsplit.models.fsdp_specs`` over ``fsdp``: default mode's train step against
bitwise with ``chunk_axes="fsdp"`` at the default chunk and at one chunk per group, and
bitwise without groups (params gathered); alternating rounds, and whether 3 steps end in the
data=1 run's bits. Goal: bitwise with FSDP groups <= 1.3x default mode's.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit import models as tf

MARKER = "fsdp_groups"
REDUCE_MARKER = "fsdp_groups_reduce"
UPDATE_MARKER = "fsdp_groups_update"
TRANSFORMER_MARKER = "fsdp_groups_transformer"
DEFAULT_TRAIN = "default mode (one jitted program)"
XLA_ENV = "UNSPLIT_BENCH_XLA_GROUP_REDUCE"  # the library's switch for measuring its old path
FSDP = "bitwise, chunk_axes='fsdp'"
DOC = "benchmarks.md"
AUTO = (AxisType.Auto, AxisType.Auto)
MODES = ("default", "bitwise, chunk_axes='fsdp'", "bitwise, no chunk_axes")


def sizes(quick: bool) -> tuple[int, int, int]:
    """(width, layers, batch)."""
    return (512, 4, 32) if quick else (2048, 8, 32)


def mesh_of(data: int) -> Mesh:
    devices = np.array(jax.devices()[: data * 4]).reshape(data, 4)
    return Mesh(devices, ("data", "fsdp"), axis_types=AUTO)


def loss_fn(params, x, key):
    h = x
    for i, w in enumerate(params):
        h = h @ w
        if i < len(params) - 1:
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, h.shape)
            h = jnp.where(keep, jax.nn.relu(h) / 0.9, 0.0)
    return jnp.mean(h**2)


def inputs(mesh: Mesh, quick: bool, dims: tuple[int, int, int] | None = None):
    width, layers, batch = dims or sizes(quick)
    sharding = NamedSharding(mesh, P("fsdp"))

    @jax.jit
    def init():
        keys = jax.random.split(jax.random.key(0), layers)
        return [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys]

    params = jax.jit(init, out_shardings=[sharding] * layers)()
    x = jax.random.normal(jax.random.key(1), (batch, width))
    x = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
    return params, x


def step_for(mode: str, mesh: Mesh):
    common_kw = {"mesh": mesh, "batch_axes": ("data", "fsdp")}
    if mode == "default":
        return unsplit.value_and_grad(loss_fn, **common_kw)
    if "chunk_axes=" in mode:  # the default chunk: 8 rows, 2 per device of a group
        return unsplit.value_and_grad(loss_fn, bitwise=True, chunk_axes="fsdp", **common_kw)
    # Without groups a device's share is 4 rows: chunks of 4.
    return unsplit.value_and_grad(loss_fn, bitwise=True, chunk_size=4, **common_kw)


def rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def train_child(mode: str, quick: bool) -> dict:
    """One mode's AdamW train step (``unsplit.train_step``) in this process: the peak RSS
    its first call adds above the params and optimizer state."""
    mesh = mesh_of(2)
    params, x = inputs(mesh, quick)
    optimizer = optax.adamw(1e-3)
    opt_state = jax.jit(optimizer.init)(params)
    key = jax.random.key(2)
    jax.block_until_ready((params, opt_state, x))
    base = rss()
    train = unsplit.train_step(step_for(mode, mesh), optimizer)
    jax.block_until_ready(train(params, opt_state, x, key))
    return {"train_peak": rss() - base}


def child(mode: str, quick: bool) -> dict:
    """One mode in this process: its compiled per-device memory and the peak RSS it adds."""
    mesh = mesh_of(2)
    params, x = inputs(mesh, quick)
    key = jax.random.key(2)
    jax.block_until_ready((params, x))
    base = rss()
    step = step_for(mode, mesh)
    out = jax.block_until_ready(step(params, x, key))
    peak = rss() - base
    compiled = common.step_memory(step, params, x, key)
    identical = None
    if "chunk_axes=" in mode:
        one = mesh_of(1)
        params1, x1 = inputs(one, quick)
        identical = unsplit.testing.bits_equal(out, step_for(mode, one)(params1, x1, key))
    return {"compiled": compiled, "peak": peak, "identical": identical}


@contextlib.contextmanager
def xla_group_sums(xla: bool):
    """The library's measuring switch on (XLA's in-group sums) for the programs made inside."""
    if xla:
        os.environ[XLA_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(XLA_ENV, None)


def grouped_step(mesh: Mesh, xla: bool, quick: bool):
    """The ``chunk_axes`` step, its programs made with XLA's in-group reduce or unsplit's,
    after one call (which makes them; the switch is read then)."""
    params, x = inputs(mesh, quick)
    key = jax.random.key(2)
    with xla_group_sums(xla):
        step = step_for(FSDP, mesh)
        out = jax.block_until_ready(step(params, x, key))
    return step, out, (params, x, key)


def reduce_rows(quick: bool) -> tuple[str, list[str], list[list[str]]]:
    """The in-group reduce: unsplit's fixed order vs XLA's reduce-scatter, side by side."""
    mesh = mesh_of(2)
    names = {"unsplit's fixed order (now)": False, "XLA's reduce-scatter (before)": True}
    runs = {name: grouped_step(mesh, xla, quick) for name, xla in names.items()}
    costs = {
        name: unsplit.testing.bitwise_cost(step, *args) for name, (step, _, args) in runs.items()
    }
    same = {
        name: unsplit.testing.bits_equal(out, grouped_step(mesh_of(1), names[name], quick)[1])
        for name, (_, out, _) in runs.items()
    }
    timed = common.compare(
        {name: (lambda s=step, a=a: s(*a)) for name, (step, _, a) in runs.items()},
        baseline="XLA's reduce-scatter (before)",
        repeats=3 if quick else 5,
        inner=1,
        warmup=1,
    )
    default = step_for("default", mesh)
    params, x, key = runs["unsplit's fixed order (now)"][2]
    default_sent = unsplit.testing.bytes_sent(default.lower(params, x, key).compile())
    header = ["in-group sum (data=2, fsdp=4)", "bytes sent per device, one chunk program",
              "per step (pack + chunks + combine)", "step time vs XLA's (median, min-max)",
              "per-device memory (XLA's analysis)", "bit-identical to data=1"]  # fmt: skip
    cells = [
        [
            name,
            f"{costs[name].chunk_bytes_sent / 2**20:.2f} MiB",
            f"{costs[name].bytes_sent_per_device / 2**20:.2f} MiB",
            common.ratio_cell(r),
            f"{costs[name].memory_per_device / 2**20:.1f} MiB",
            "yes" if same[name] else "NO",
        ]
        for name, r in zip(runs, timed, strict=True)
    ]
    default_memory = common.compiled_bytes(default.lower(params, x, key).compile())
    cells.append(
        ["default mode (one program)", "-", f"{default_sent / 2**20:.2f} MiB", "-",
         f"{default_memory / 2**20:.1f} MiB", "-"]
    )  # fmt: skip
    width, layers, batch = sizes(quick)
    title = (
        f"FSDP groups' in-group sum: {width * width * layers / 1e6:.1f}M-param MLP, batch {batch}, "
        f"chunks of 8 rows (2 per device), {costs[next(iter(runs))].chunk_programs} per group"
    )
    return title, header, cells


def clipped_adamw():
    return optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-3))


def update_sizes(quick: bool) -> tuple[int, int, int]:
    """(width, layers, batch) of the train-step rows: a quarter of the step rows' params (two
    train steps side by side hold their params, states and programs' buffers at once)."""
    return sizes(True) if quick else (1024, 8, 32)


def sharded_like(opt_state, params, mesh: Mesh):
    """The optimizer state as FSDP holds it: each leaf shaped like a param with that param's
    sharding, the rest replicated. (``jax.jit(optimizer.init)`` left AdamW's moments
    replicated here: every device then updated the whole moments, in both modes.)"""
    by_shape = {p.shape: p.sharding for p in jax.tree.leaves(params)}
    replicated = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.device_put(x, by_shape.get(x.shape, replicated)), opt_state)


def grouped_train(mesh: Mesh, xla: bool, quick: bool, mode: str = FSDP):
    """A ``chunk_axes`` train step (clip + AdamW) after one call, its update made with XLA's
    in-group sums or unsplit's (``mode="default"``: default mode's train step, one jitted
    program, at the same layout); returns a zero-argument step that carries its own state."""
    params, x = inputs(mesh, quick, update_sizes(quick))
    optimizer = clipped_adamw()
    state = {"params": params, "opt": sharded_like(jax.jit(optimizer.init)(params), params, mesh)}
    key = jax.random.key(2)
    train = unsplit.train_step(step_for(mode, mesh), optimizer)

    def one_step():
        _, state["params"], state["opt"] = train(state["params"], state["opt"], x, key)
        return state["params"]

    with xla_group_sums(xla):
        jax.block_until_ready(one_step())
    return one_step, state


def update_rows(quick: bool) -> tuple[str, list[str], list[list[str]]]:
    """A train step's in-group sums (chunk programs and update): unsplit's fixed order vs
    XLA's collectives, side by side."""
    names = {"unsplit's fixed order (now)": False, "XLA's collectives (before)": True}
    runs = {name: grouped_train(mesh_of(2), xla, quick) for name, xla in names.items()}
    runs[DEFAULT_TRAIN] = grouped_train(mesh_of(2), False, quick, mode="default")
    # Three calls a measurement: with one, single slow calls (a core taken by another job)
    # moved a median of 7 rounds by 2x.
    timed = common.compare(
        {name: (lambda f=f: f()) for name, (f, _) in runs.items()},
        baseline=DEFAULT_TRAIN,
        repeats=3 if quick else 7,
        inner=3,
        warmup=1,
    )
    # Against XLA's in-group collectives: the same rounds' medians.
    xla_s = next(r.median_s for r in timed if r.name == "XLA's collectives (before)")
    del runs  # their buffers, before the bit checks make their own
    same = {}
    for name, xla in names.items():  # fresh 3-step runs: data=2 vs data=1, bit for bit
        ends = []
        for data in (2, 1):
            one_step, state = grouped_train(mesh_of(data), xla, quick)
            one_step(), one_step()
            ends.append(jax.device_get((state["params"], state["opt"])))
        same[name] = unsplit.testing.bits_equal(*ends)
        del one_step, state, ends
    header = ["in-group sums, chunk programs and update (data=2, fsdp=4)", "train step time vs default mode's (median, min-max)",
              "vs XLA's collectives (ratio of medians)", "3 steps bit-identical to data=1"]  # fmt: skip
    cells = [
        [
            r.name,
            common.ratio_cell(r),
            common.times_cell(common.ratio(r.median_s, xla_s)),
            ("yes" if same[r.name] else "NO") if r.name in same else "-",
        ]
        for r in timed
    ]
    width, layers, batch = update_sizes(quick)
    title = (
        f"FSDP groups' train step (`clip_by_global_norm(0.1)` + AdamW, update on the groups' shards): "
        f"{width * width * layers / 1e6:.1f}M-param MLP, batch {batch}"
    )
    return title, header, cells


def transformer_train(data: int, options: dict, quick: bool):
    """A train step (clip + AdamW) of the tiny Transformer on a (data, fsdp=4) mesh, params and
    optimizer state sharded by ``fsdp_specs``, after one call; returns a zero-argument step
    that carries its own state, and the state."""
    config = tf.TransformerConfig(width=32, layers=1) if quick else tf.TransformerConfig()
    model = tf.Transformer(config)
    mesh = mesh_of(data)
    params = jax.tree.map(np.asarray, tf.init_params(model, 0))
    specs = unsplit.models.fsdp_specs(params, "fsdp", 4)
    params = unsplit.models.on_mesh(params, mesh, specs)
    optimizer = clipped_adamw()
    state = {"params": params, "opt": sharded_like(jax.jit(optimizer.init)(params), params, mesh)}
    batch = tf.synthetic_batch(config, TRANSFORMER_BATCH, seed=1)
    batch = jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp"))))
    step = unsplit.value_and_grad(
        tf.token_loss(model), weighted=True, mesh=mesh, batch_axes=("data", "fsdp"), **options
    )
    train = unsplit.train_step(step, optimizer)
    key = jax.random.key(2)

    def one_step():
        _, state["params"], state["opt"] = train(state["params"], state["opt"], batch, key)
        return state["params"]

    jax.block_until_ready(one_step())
    return one_step, state


TRANSFORMER_BATCH = 64
# Rows per group at data=2: 64 / 2 = 32, one chunk per group.
TRANSFORMER_MODES = {
    DEFAULT_TRAIN: {},
    "bitwise, chunk_axes='fsdp', default chunk": {"bitwise": True, "chunk_axes": "fsdp"},
    "bitwise, chunk_axes='fsdp', chunk_size=32 (one chunk per group)": {
        "bitwise": True, "chunk_axes": "fsdp", "chunk_size": 32},
    "bitwise, no chunk_axes (params gathered), chunk_size=8": {"bitwise": True, "chunk_size": 8},
}  # fmt: skip


def transformer_rows(quick: bool) -> tuple[str, list[str], list[list[str]]]:
    """The tiny Transformer's FSDP train step: bitwise (with and without groups) vs default."""
    runs = {
        name: transformer_train(2, options, quick)[0] for name, options in TRANSFORMER_MODES.items()
    }
    timed = common.compare(
        {name: (lambda f=f: f()) for name, f in runs.items()},
        baseline=DEFAULT_TRAIN,
        repeats=3 if quick else 11,
        inner=3,
        warmup=1,
    )
    del runs
    same = {}
    for name, options in TRANSFORMER_MODES.items():
        if not options:
            continue
        ends = []
        for data in (2, 1):
            one_step, state = transformer_train(data, options, quick)
            one_step(), one_step()
            ends.append(jax.device_get((state["params"], state["opt"])))
        same[name] = unsplit.testing.bits_equal(*ends)
    header = ["train step (data=2, fsdp=4)", "time vs default mode's (median, min-max)",
              "3 steps bit-identical to data=1"]  # fmt: skip
    cells = [
        [r.name, common.ratio_cell(r), ("yes" if same[r.name] else "NO") if r.name in same else "-"]
        for r in timed
    ]
    n_params = sum(x.size for x in jax.tree.leaves(tf.init_params(tf.Transformer(
        tf.TransformerConfig(width=32, layers=1) if quick else tf.TransformerConfig()), 0)))  # fmt: skip
    title = (
        f"FSDP groups' train step on the tiny Transformer (`clip_by_global_norm(0.1)` + AdamW, "
        f"{n_params / 1e3:.0f}k params, batch {TRANSFORMER_BATCH}, token-weighted loss)"
    )
    return title, header, cells


def run_child(mode: str, quick: bool, train: bool = False) -> dict:
    argv = [sys.executable, __file__, "--child", mode] + (["--quick"] if quick else [])
    argv += ["--train"] if train else []
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{mode}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--child", help=argparse_hidden())
    parser.add_argument("--train", action="store_true", help=argparse_hidden())
    parser.add_argument("--reduce", action="store_true", help="only the in-group sum's rows")
    parser.add_argument("--update", action="store_true", help="only the train step's rows")
    parser.add_argument(
        "--transformer", action="store_true", help="only the tiny Transformer's train step rows"
    )
    args = parser.parse_args()
    if args.reduce:
        reduce_table(args)
        return
    if args.update:
        update_table(args)
        return
    if args.transformer:
        side_table(args, transformer_rows, TRANSFORMER_MARKER)
        return
    if args.child:
        run = train_child if args.train else child
        print(json.dumps(run(args.child, args.quick)))
        return
    width, layers, batch = sizes(args.quick)
    n_params = width * width * layers
    results = {
        mode: run_child(mode, args.quick) | run_child(mode, args.quick, True) for mode in MODES
    }
    base = results["default"]
    header = ["mode (data=2, fsdp=4)", "per-device memory (XLA's analysis)", "vs default",
              "process peak above params (8 devices)", "vs default",
              "AdamW train step: process peak above params and state", "vs default",
              "bit-identical to data=1"]  # fmt: skip
    cells = []
    for mode, r in results.items():
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        cells.append(
            [
                mode,
                f"{r['compiled'] / 2**20:.1f} MiB",
                common.times_cell(common.ratio(r["compiled"], base["compiled"])),
                f"{r['peak'] / 2**20:.0f} MiB",
                common.times_cell(common.ratio(r["peak"], base["peak"])),
                f"{r['train_peak'] / 2**20:.0f} MiB",
                common.times_cell(common.ratio(r["train_peak"], base["train_peak"])),
                same,
            ]
        )
    title = (
        f"FSDP groups: {n_params / 1e6:.1f}M-param MLP ({layers} x {width}x{width}, f32), "
        f"batch {batch}, params sharded over fsdp"
    )
    common.print_table(title, header, cells)
    if common.should_write(args):
        body = f"{title}:\n\n{common.markdown_table(header, cells)}"
        common.write_table(DOC, MARKER, body)
    reduce_table(args)
    side_table(args, transformer_rows, TRANSFORMER_MARKER)


def side_table(args, rows, marker: str) -> None:
    """A side-by-side table (:func:`reduce_rows` or :func:`update_rows`), printed and written
    to the docs between ``marker``'s comments."""
    title, header, cells = rows(args.quick)
    common.print_table(title, header, cells)
    if common.should_write(args):
        common.write_table(DOC, marker, f"{title}:\n\n{common.markdown_table(header, cells)}")


def reduce_table(args) -> None:
    side_table(args, reduce_rows, REDUCE_MARKER)


def update_table(args) -> None:
    side_table(args, update_rows, UPDATE_MARKER)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
