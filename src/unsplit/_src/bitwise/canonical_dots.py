"""Chunk programs whose bits do not depend on the process's CPU thread count.

XLA's CPU client runs a device's matmuls on an intra-op thread pool of
``T = min(max(CPUs in the affinity mask, device count), 256)`` threads. Eigen,
which runs the dots that the XNNPACK/YNNPACK library path does not take (the
weight-gradient dots, whose LHS contracts dimension 0), splits a dot's
contraction by ``T`` at run time: the same compiled program gives other bits in
a process with another ``T`` -- e.g. a one-device step in a process started with
8 simulated devices and in a process with 1 (the Bitwise mode guide has the measurement:
https://unsplit.readthedocs.io/en/latest/bitwise/).

Two things together make the bits independent of ``T`` (the same guide;
tested with ``T`` = 1 and 16 in fresh processes):

1. :func:`canonicalize` rewrites every ``dot_general`` of the (already
   differentiated) program so both operands are laid out ``(batch dims, free
   dims, contracting dims)``, with an ``optimization_barrier`` on the
   reordered operands and on the output so XLA cannot fold the transposes
   back. It walks ``jit``, ``custom_jvp``/``custom_vjp``, ``remat``, ``scan``,
   ``cond``, ``while`` and ``shard_map`` bodies.
2. :func:`cpu_options` sends those dots to the YNNPACK library path, which
   does not split by ``T``.

So that the programs of other tensor, sequence or FSDP-group degrees (other fusions,
other array lengths) give the same bits for the same canonical blocks, :func:`canonicalize`
also rounds every product on its own (:func:`rounded`: XLA:CPU would fuse it into an add)
and, on XLA:CPU's legacy emitter, computes ``exp`` with one code path (:func:`_exp`).

:func:`check_cpu_program` then refuses a compiled CPU program that still holds
a real floating-point ``dot`` on Eigen, and warns on a ``convolution`` or a
complex dot (not fixed: their bits may still depend on the thread count).
Matrix-vector and integer dots need nothing (XLA emits matvecs as loops that
are not threaded; integer sums are exact). Only CPU programs are changed;
other backends compile the program as it is.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core
from jax.extend.core import primitives

from unsplit._src.step import dot_transposes, jaxpr_eval

# XLA:CPU at its default level fuses a multiply feeding an add into one FMA (one rounding),
# following fusion choices that differ between programs of other degrees; level 0 rounds as
# written but cost 1.5-2x a step. The chunk programs compile at the default level with every
# product behind an identity XLA cannot see through (:func:`rounded`); what followed the
# array's length (0.10.2: `exp`, :func:`_exp`; 0.12.1: `tanh`, vectors of one element) is
# fixed too; `erf` is left as XLA computes it. Measured: the guide, "XLA's CPU optimization level".
_DEFAULT_LEVEL: dict[str, str | bool] = {"xla_backend_optimization_level": "3"}
# Level 0 rounds as written without the identities (:func:`exact_elementwise`; the FSDP
# groups' fixed-order update compiled there until it took the chunk programs' options).
_EXACT_ELEMENTWISE: dict[str, str | bool] = {"xla_backend_optimization_level": "0"}

# A measuring switch, not a setting: with it "1" (read when a step's programs are made; in
# their cache key) the CPU chunk programs compile as XLA fuses them: bits kept across data
# degrees and microbatches, not model-parallel degrees (lora_bench, degrees_bench: one row).
BENCH_DEFAULT_LEVEL_ENV = "UNSPLIT_BENCH_CPU_DEFAULT_LEVEL"


def exact() -> bool:
    """Whether bitwise CPU programs made now round every elementwise operation as written."""
    return os.environ.get(BENCH_DEFAULT_LEVEL_ENV) != "1"


# The test suite's switch (conftest.py), not a setting: with it "1" (in the cache key) the
# CPU chunk programs compile at the process's level (the suite's 0), rounding kept.
SUITE_PROCESS_LEVEL_ENV = "UNSPLIT_TEST_CHUNK_PROGRAMS_AT_PROCESS_LEVEL"


def pinned_level() -> bool:
    """Whether bitwise CPU chunk programs made now compile at XLA's default level."""
    return os.environ.get(SUITE_PROCESS_LEVEL_ENV) != "1"


# YNNPACK fusions for dots only. Not ELTWISE (which XLA's CPU default has): elementwise
# ops give the same bits at any thread count in XLA's own loop fusions (measured: the test
# transformer's bitwise grads at 1 and 16 threads), and with it the test transformer's
# chunk program needed 2x the temp memory (7.7 vs 3.9 MiB, with or without the rewrite) and
# ran about 1.15x slower. Not REDUCE (not needed for the guarantee, not measured).
_DOTS_ON_THE_LIBRARY: dict[str, str | bool] = {
    "xla_cpu_experimental_ynn_fusion_type": (
        "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
    ),
}


@functools.cache
def exact_elementwise() -> dict[str, str | bool]:
    """The compile options under which XLA:CPU rounds every elementwise operation of a
    program as written, in every fusion and at every length: backend level 0 (no fused
    multiply-adds, no vectorized loops), and on XLA:CPU without its legacy elementwise
    emitter (JAX 0.12.1), vectors of one element (its own emitter vectorizes even at level
    0: `tanh`, `erf`, `rsqrt` and `x * 1.1 + 0.3` gave other bits alone, one element at a
    time or fused with a transpose). Bitwise mode's programs round their products instead
    and compile at the default level (:func:`cpu_options`), which cost less.

    Example:
        >>> from unsplit._src.bitwise import canonical_dots
        >>> canonical_dots.exact_elementwise()["xla_backend_optimization_level"]
        '0'
    """
    if _legacy_emitter():
        return dict(_EXACT_ELEMENTWISE)
    return {**_EXACT_ELEMENTWISE, "xla_cpu_prefer_vector_width": "1"}


@functools.cache
def _legacy_emitter() -> bool:
    """Has this process's XLA:CPU its legacy elementwise emitter (JAX 0.10.2: it accepts the
    option that turns its newer fusion emitters off; 0.12.1 refuses the name)?"""
    x = jax.device_put(np.float32(0), jax.devices("cpu")[0])
    try:
        jax.jit(lambda v: v + 1).lower(x).compile({"xla_cpu_use_fusion_emitters": True})
    except jax.errors.JaxRuntimeError:
        return False
    return True


def cpu_options() -> dict[str, str | bool]:
    """Bitwise mode's CPU chunk programs' compile options: dots on the YNNPACK library path,
    XLA's default level whatever the process's flags (the programs' products are rounded by
    :func:`canonicalize`), and on XLA:CPU without its legacy emitter vectors of one element.
    The type ``compile()`` takes."""
    if not exact():
        return dict(_DOTS_ON_THE_LIBRARY)
    one_wide = {} if _legacy_emitter() else {"xla_cpu_prefer_vector_width": "1"}
    level = _DEFAULT_LEVEL if pinned_level() else {}
    return {**_DOTS_ON_THE_LIBRARY, **level, **one_wide}


_INLINED = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


def is_cpu(devices) -> bool:
    """Do these devices run XLA's CPU client (the only one whose dots :func:`cpu_options` fix)?"""
    return all(d.platform == "cpu" for d in devices)


def canonicalize(fn):
    """``fn`` with every ``dot_general`` in canonical layout (after any AD inside ``fn``).

    The result traces ``fn`` once per call's input types (like ``jax.jit``)
    and evaluates its jaxpr with the rewritten dots; jit it to compile.
    """

    def wrapped(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = _eval(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), out)

    return wrapped


def _canonical_dot(lhs, rhs, *, dimension_numbers, **params):
    (lc, rc), (lb, rb) = dimension_numbers
    lfree = [d for d in range(lhs.ndim) if d not in (*lc, *lb)]
    rfree = [d for d in range(rhs.ndim) if d not in (*rc, *rb)]
    lhs = jax.lax.transpose(lhs, (*lb, *lfree, *lc))
    # YNNPACK takes the right operand as (batch, contracting, free) or (batch, free,
    # contracting): one already in either layout is used as it is stored, so a weight
    # `x @ w` reads is not copied transposed (which XLA then transposed back) every chunk.
    rkept = (*rb, *rc, *rfree)
    rorder = rkept if rkept == tuple(range(rhs.ndim)) else (*rb, *rfree, *rc)
    rhs = jax.lax.transpose(rhs, rorder)
    lhs, rhs = jax.lax.optimization_barrier((lhs, rhs))
    nb, nc = len(lb), len(lc)
    batch = tuple(range(nb))
    contract_l = tuple(range(nb + len(lfree), nb + len(lfree) + nc))
    first = nb if rorder == rkept else nb + len(rfree)
    contract_r = tuple(range(first, first + nc))
    numbers = ((contract_l, contract_r), (batch, batch))
    out = primitives.dot_general_p.bind(lhs, rhs, dimension_numbers=numbers, **params)
    return jax.lax.optimization_barrier(out)


def rounded(y):
    """``y``, with the same bits, behind an identity that XLA and LLVM cannot see through:
    a product passed through it is rounded on its own, never fused into an add.

    ``u | ((u * (u + 1)) & 1)`` of ``y``'s bits ``u``: the product of two consecutive
    integers is even, so the ``or`` adds nothing, but no compiler pass proves it (measured:
    ``x * w`` materialized in one program and fused into ``+ b`` in another then give the
    same bits, and the two-rounding ones). Three integer operations per element.

    Example:
        >>> import jax.numpy as jnp
        >>> from unsplit._src.bitwise import canonical_dots
        >>> x = jnp.array([1.5, -0.0, jnp.inf, jnp.nan])
        >>> bool(jnp.all(canonical_dots.rounded(x).view(jnp.uint32) == x.view(jnp.uint32)))
        True
    """
    if not jnp.issubdtype(y.dtype, jnp.floating):
        return y
    bits = jnp.dtype(f"uint{jnp.finfo(y.dtype).bits}")
    u = jax.lax.bitcast_convert_type(y, bits)
    one = jnp.ones((), bits)
    zero = jax.lax.bitwise_and(u * (u + one), one)
    return jax.lax.bitcast_convert_type(jax.lax.bitwise_or(u, zero), y.dtype)


def _exp(x):
    """``exp(x)`` from ``expm1`` and exactly rounded operations, one code path at every array
    length. XLA:CPU (JAX 0.10.2) at its default level computes ``exp`` in a vectorized loop
    for some lengths (3, 5-7, 11, 13-15 of 1-19) with other bits than in its scalar loop;
    its ``expm1`` gave the same bits at every length. ``expm1(x) + 1`` for ``x >= 0``,
    ``1 / (expm1(-x) + 1)`` below. Measured within 3.9 ulp of the exact value over 1.2M
    samples, 3.3 below 88 (XLA's own: 1.0 below 88, 3.9 near overflow); +-inf and NaN kept; results below the smallest normal flush to 0, as
    XLA:CPU's own (it computes with denormals flushed)."""
    wide = x.dtype if jnp.finfo(x.dtype).bits >= 32 else jnp.float32
    v = x.astype(wide)
    up = rounded(jnp.expm1(jnp.abs(v))) + 1
    return jnp.where(v >= 0, up, 1 / up).astype(x.dtype)


# Primitives lowered to a multiply or to code that may end in one (XLA rewrites a division by
# a constant into a multiply; a function's last step may be a multiply): their results are
# rounded on their own (:func:`rounded`), so no add of a consumer is fused into them.
_ROUNDED = frozenset(
    [
        "mul",
        "integer_pow",
        "square",
        "div",
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "tanh",
        "logistic",
        "erf",
        "erfc",
        "erf_inv",
        "sin",
        "cos",
        "tan",
        "atan",
        "atan2",
        "pow",
        "rsqrt",
        "cbrt",
        "lgamma",
        "digamma",
    ]
)


def _retrace(jaxpr: core.Jaxpr, consts) -> tuple[core.Jaxpr, list[Any]]:
    """``jaxpr`` (with ``consts``) traced again through :func:`_eval`: the same types."""
    return jaxpr_eval.retrace(jaxpr, consts, _eval)


def _eval(jaxpr: core.Jaxpr, consts, *args) -> list[Any]:
    rewrite = dot_transposes.folded(jaxpr, _equation)
    return jaxpr_eval.evaluate(jaxpr, consts, args, rewrite, eqn_context=True)


def _equation(eqn: core.JaxprEqn, invals: list[Any]) -> Any:
    """One equation's outputs, its dots (and those of its nested jaxprs) canonical."""
    name = eqn.primitive.name
    if eqn.primitive is primitives.dot_general_p:
        return _canonical_dot(*invals, **eqn.params)
    if name in _ROUNDED and exact():
        if name == "exp" and _legacy_emitter() and jnp.issubdtype(invals[0].dtype, jnp.floating):
            return _exp(*invals)  # ends in an add or a division: nothing to fuse into an add
        return rounded(jaxpr_eval.bind(eqn, invals, eqn.params))  # real floats only
    if name in _INLINED:  # post-AD: the primal computation, nothing differentiates it
        body: Any = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
        return _eval(body.jaxpr, body.consts, *invals)
    if name == "shard_map":
        return _shard_map(eqn.params, invals)
    params = {k: jaxpr_eval.nested(v, _retrace) for k, v in eqn.params.items()}
    return jaxpr_eval.bind(eqn, invals, params)


def _shard_map(params, invals) -> list[Any]:
    """A ``shard_map`` equation again, through ``jax.shard_map``, its body via :func:`_eval`."""
    body = params["jaxpr"]
    mapped = jax.shard_map(
        lambda *args: tuple(_eval(body, (), *args)),
        mesh=params["mesh"],
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]),
        axis_names=set(params.get("manual_axes", params.get("newly_manual_axes", ()))),
        check_vma=params["check_vma"],
    )
    return list(mapped(*invals))


# An HLO instruction's name and array shape (`%x = f32[8,16]{1,0} op(...)`).
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]")
# A plain HLO dot or convolution instruction, and a dot's operands and dimensions.
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s(dot|convolution)\(")
_OPERANDS = re.compile(r"\sdot\(%?([\w.\-]+),\s*%?([\w.\-]+)\)")
_DTYPE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\w+)\[")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_LIBRARY = re.compile(r"calls=%?([\w.\-]+).*__ynn_fusion")
# XLA 0.12.1+ emits small dots inside loop fusions (``wrapped_dot``): LLVM IR loops, each
# output element's sum in one thread, as for matrix-vector dots (not Eigen's thread pool).
_LOOP_FUSION = re.compile(r"kind=kLoop, calls=%?([\w.\-]+)")


def _dims(line: str, name: str) -> set[int]:
    found = re.search(rf"{name}=\{{([\d,]*)\}}", line)
    return {int(d) for d in found.group(1).split(",") if d} if found else set()


def _is_vector_product(line: str, shapes: dict[str, list[int]]) -> bool:
    """A dot where one side has no free elements beyond 1: XLA emits it as an LLVM IR
    loop (matrix-vector), not on Eigen's thread pool (the same bits at any thread count)."""
    operands = _OPERANDS.search(line)
    if not operands or any(o not in shapes for o in operands.groups()):
        return False
    for side, name in zip(("lhs", "rhs"), operands.groups(), strict=True):
        taken = _dims(line, f"{side}_batch_dims") | _dims(line, f"{side}_contracting_dims")
        free = [n for d, n in enumerate(shapes[name]) if d not in taken]
        if all(n == 1 for n in free):
            return True
    return False


def plain_ops(text: str) -> dict[str, list[str]]:
    """``{"dot": [...], "complex dot": [...], "convolution": [...]}``: the HLO lines of
    ``text`` that Eigen runs, with bits that may depend on the thread count.

    Not listed: a dot inside a computation that a YNNPACK fusion calls (the
    library path), a matrix-vector dot or a dot in a loop fusion (an LLVM IR loop,
    not threaded over its sums), an integer dot (exact in any order).
    """
    library = set(_LIBRARY.findall(text)) | set(_LOOP_FUSION.findall(text))
    shapes = {
        m.group(1): [int(d) for d in m.group(2).split(",") if d]
        for m in map(_DEFINITION.match, text.splitlines())
        if m
    }
    found: dict[str, list[str]] = {"dot": [], "complex dot": [], "convolution": []}
    computation = None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and "=" not in line.split("{")[0].split("(")[0]:
            computation = head.group(1)
            continue
        op = _OP.match(line)
        if not op or computation in library:
            continue
        kind = op.group(1)
        if kind == "dot":
            dtype = _DTYPE.match(line)
            dtype = dtype.group(1) if dtype else ""
            if dtype.startswith(("s", "u", "pred")) or _is_vector_product(line, shapes):
                continue  # integer sums are exact in any order; matvecs are not threaded
            if dtype.startswith("c"):
                kind = "complex dot"
        found[kind].append(line.strip())
    return found


def check_cpu_program(compiled, *, warn_unfixed: bool = True) -> None:
    """Warns if a compiled CPU chunk program still runs a dot on Eigen (thread-dependent bits).

    A warning, not an error: the step is still bit-identical across schedules in
    processes with the same thread count, as it was before the rewrite.
    """
    found = plain_ops(compiled.as_text())
    if found["dot"]:
        shown = "\n  ".join(line[:200] for line in found["dot"][:5])
        warnings.warn(
            "bitwise mode: the compiled CPU chunk program still runs "
            f"{len(found['dot'])} dot(s) on XLA's Eigen path, whose bits depend on the "
            "process's thread count (CPUs in the affinity mask, simulated device count). "
            "Expected: every dot on the YNNPACK library path (a `__ynn_fusion`); got:\n  "
            f"{shown}\nFix: report this with your loss function (a primitive whose body "
            "unsplit does not rewrite, or a new XLA version), and meanwhile run every "
            "process you compare with the same number of CPUs and the same "
            "--xla_force_host_platform_device_count.",
            stacklevel=2,
        )
    unfixed = {k: len(found[k]) for k in ("complex dot", "convolution") if found[k]}
    if unfixed and warn_unfixed:
        what = " and ".join(f"{n} {k}(s)" for k, n in unfixed.items())
        warnings.warn(
            f"bitwise mode: the chunk program has {what}, which run on XLA's Eigen path "
            "on CPU: their bits may depend on the process's thread count (CPUs in the "
            "affinity mask and the simulated device count), which bitwise mode does not fix "
            "for them. Bits stay identical across schedules within processes that have the "
            "same thread count. Fix: run the processes you compare with the same CPUs "
            "(taskset) and the same --xla_force_host_platform_device_count.",
            stacklevel=3,
        )
