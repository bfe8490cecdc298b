"""Cheap fingerprints of array values, and an on-device check that replicas agree.

In a multi-process program every process passes its own copy of the values
that must be equal everywhere (params, the step key). Sharded data exists once,
so only *replicated* data can disagree. Two tools check it:

* :func:`fingerprint` hashes values on device: one jitted pass of integer
  arithmetic over their bits (wrapping sums of mixed 32-bit words). Integer
  sums are exact and associative, so the result does not depend on how XLA
  orders the reduction: the same bits give the same fingerprint on any device,
  in any process. Any difference in the values (one bit) changes it, except
  with probability about ``2**-64``.
* :func:`replicas_agree` runs inside a (possibly the user's) ``jax.jit``: every
  device fingerprints its copy and a small ``all_gather`` over the mesh axes the
  value is replicated along compares them. It returns a replicated ``bool``
  without a host sync, so a step can poison its outputs (:func:`poison_unless`)
  or raise from a host callback (:func:`raise_unless`) only when they differ.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib.version
import numpy as np
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src import partition

_GOLDEN = np.uint32(0x9E3779B9)
_SEEDS = (np.uint32(0x243F6A88), np.uint32(0x85A308D3))  # two independent 32-bit lanes


def _mix(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: every input bit flips about half the output bits."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def words(x: Any) -> jax.Array:
    """The bits of ``x`` as a flat ``uint32`` array (typed keys: their key data)."""
    x = jax.random.key_data(x) if keys_lib.is_typed_key(x) else jnp.asarray(x)
    dtype = jnp.dtype(x.dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)])
        dtype = jnp.dtype(x.dtype)
    if dtype == jnp.bool_:
        return x.astype(jnp.uint32).reshape(-1)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned)  # 8-byte items: a trailing axis of 2
    return bits.astype(jnp.uint32).reshape(-1)


def leaf_fingerprint(x: Any) -> jax.Array:
    """``uint32[2]``: a 64-bit hash of one array's bits (shape and dtype not included)."""
    w = words(x)
    position = jnp.arange(w.size, dtype=jnp.uint32) * _GOLDEN
    lanes = [jnp.sum(_mix(w ^ _mix(position + seed)), dtype=jnp.uint32) for seed in _SEEDS]
    return jnp.stack(lanes)


def fingerprint(tree: Any) -> jax.Array:
    """Returns ``uint32[n, 2]``: a 64-bit fingerprint of each leaf's values.

    Jittable; outside ``jit`` it runs where the leaves live. Equal bits give
    equal fingerprints on every device and process; use it on values each
    process holds whole (host arrays, one replica of a replicated array).

    Example:
        >>> import jax.numpy as jnp
        >>> from unsplit._src.processes.fingerprint import fingerprint
        >>> a = fingerprint({"w": jnp.ones(3), "b": jnp.zeros(2)})
        >>> a.shape, a.dtype.name
        ((2, 2), 'uint32')
        >>> bool((a == fingerprint({"w": jnp.ones(3), "b": jnp.zeros(2)})).all())
        True
        >>> bool((a == fingerprint({"w": jnp.ones(3), "b": jnp.full(2, 1e-30)})).all())
        False
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((0, 2), jnp.uint32)
    return jnp.stack([leaf_fingerprint(x) for x in leaves])


def _default_spec(x: Any) -> P:
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return spec if isinstance(spec, P) else P()


def replicas_agree(tree: Any, mesh: jax.sharding.Mesh, specs: Sequence[P] | None = None):
    """Returns a replicated ``bool`` scalar: do all replicas of ``tree`` hold the same bits?

    Works on concrete arrays and inside ``jax.jit`` (a user's jitted train step
    included): each device fingerprints its block of every leaf, and one small
    ``all_gather`` (8 bytes per leaf) over the mesh axes a leaf is *not* sharded
    over compares the copies. No host sync: the answer stays on device.

    Args:
        tree: a pytree of arrays (typed keys allowed) laid out on ``mesh``.
        mesh: the mesh whose devices hold the replicas (all processes' devices
            in a multi-process program).
        specs: one ``PartitionSpec`` per leaf (in ``jax.tree.leaves`` order).
            By default each leaf's own spec where the mesh has Explicit axes,
            else ``P()`` (replicated over the whole mesh).

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from unsplit._src.processes.fingerprint import replicas_agree
        >>> mesh = jax.make_mesh((2,), ("data",))
        >>> same = jax.device_put(jnp.ones(3), jax.NamedSharding(mesh, jax.P()))
        >>> bool(replicas_agree({"w": same}, mesh))
        True
        >>> sharding = jax.NamedSharding(mesh, jax.P())
        >>> per_device = [np.full(3, float(i), np.float32) for i in range(2)]
        >>> differ = jax.make_array_from_single_device_arrays(
        ...     (3,), sharding, [jax.device_put(v, d) for v, d in
        ...                     zip(per_device, sharding.mesh.devices.flat)])
        >>> bool(replicas_agree({"w": differ}, mesh))
        False
    """
    leaves = [
        jax.random.key_data(x) if keys_lib.is_typed_key(x) else x for x in jax.tree.leaves(tree)
    ]
    if specs is None:
        specs = [_default_spec(x) for x in jax.tree.leaves(tree)]
    specs = list(specs)
    if len(specs) != len(leaves):
        raise ValueError(
            f"specs must give one PartitionSpec per leaf; got {len(specs)=} for "
            f"{len(leaves)} leaves. Fix: pass specs=None, or one spec per leaf."
        )
    return _checker(mesh, tuple(specs))(leaves)


@functools.lru_cache(maxsize=64)
def _checker(mesh: jax.sharding.Mesh, specs: tuple[P, ...]):
    """The jitted check for one (mesh, specs): compiled once, inlined inside a caller's jit."""
    axes = tuple(mesh.axis_names)
    # Leaves replicated along the same axes are compared by one all_gather.
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, spec in enumerate(specs):
        replica_axes = tuple(a for a in axes if a not in partition.spec_axes(spec))
        if replica_axes:
            groups.setdefault(replica_axes, []).append(i)

    def local(*blocks):
        ok = jnp.bool_(True)
        for replica_axes, members in groups.items():
            fps = jnp.stack([leaf_fingerprint(blocks[i]) for i in members])
            # Salt each copy with its device's position before the gather: a value XLA
            # knows to be replicated could otherwise be "gathered" as local copies.
            index = jnp.uint32(0)
            for a in replica_axes:
                index = index * np.uint32(mesh.shape[a]) + jax.lax.axis_index(a).astype(jnp.uint32)
            salt = _mix(index + np.uint32(1))
            gathered, salts = jax.lax.all_gather((fps ^ salt, salt), replica_axes)
            copies = gathered ^ salts.reshape(-1, 1, 1)
            ok = ok & jnp.all(copies == copies[:1])
        # Every device returns the same answer: the minimum over the whole mesh.
        return jax.lax.pmin(ok.astype(jnp.int32), axes) > 0

    @jax.jit
    def check(leaves):
        if not groups:
            return jnp.bool_(True)
        run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
        return run(*leaves)

    return check


def poison_unless(ok: jax.Array, tree: Any) -> Any:
    """``tree`` where ``ok``, else NaN in every inexact leaf (integer leaves unchanged)."""

    def poison(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return jnp.where(ok, x, jnp.nan)
        return x

    return jax.tree.map(poison, tree)


def raise_unless(ok: jax.Array, message: str) -> None:
    """Inside ``jit``: a host callback that raises ``message`` only when ``ok`` is False.

    The callback sits in the false branch of a ``lax.cond``, so when the
    values agree it costs nothing on the host. On a mismatch every process
    raises (``ok`` is the same everywhere); the error surfaces when the
    step's outputs are read, as a ``JaxRuntimeError`` carrying ``message``.
    """

    def fail():
        raise ValueError(message)

    jax.lax.cond(ok, lambda: None, lambda: jax.debug.callback(fail, partitioned=True))


@functools.cache
def _jitted_fingerprint():
    return jax.jit(fingerprint)


def host_fingerprints(leaves: Sequence[Any]) -> list[str | None]:
    """Each leaf's fingerprint as 16 hex digits, computed where its local copy lives.

    Host values (NumPy arrays, Python scalars) are hashed by their exact bits
    (``int64`` too, without x64); a JAX array by one copy this process holds
    whole. ``None`` for an array split over several processes (it exists once:
    use :func:`replicas_agree` for its replicas). One jitted call per device
    set, one small read-back.
    """
    out: list[str | None] = [None] * len(leaves)
    groups: dict[Any, list[tuple[int, Any]]] = {}
    for i, x in enumerate(leaves):
        if keys_lib.is_typed_key(x):
            x = jax.random.key_data(x)
        if isinstance(x, jax.Array):
            if not x.is_fully_addressable:
                if not x.is_fully_replicated:
                    continue
                x = x.addressable_data(0)
            groups.setdefault(frozenset(x.sharding.device_set), []).append((i, x))
        elif (words_ := _host_words(x)) is not None:
            groups.setdefault(None, []).append((i, jax.device_put(words_)))
        else:  # not numeric (a string, an object): its repr
            out[i] = hashlib.sha256(repr(x).encode()).hexdigest()[:16]
    for members in groups.values():
        prints = np.asarray(_jitted_fingerprint()([x for _, x in members]))
        for (i, _), fp in zip(members, prints, strict=True):
            out[i] = f"{int(fp[0]):08x}{int(fp[1]):08x}"
    return out


def _host_words(x: Any) -> np.ndarray | None:
    """The same uint32 words as :func:`words`, made on the host (exact for 64-bit values)."""
    arr = np.ascontiguousarray(np.asarray(x))
    if arr.dtype == object or arr.dtype.itemsize not in (1, 2, 4, 8, 16) or arr.dtype.kind in "USO":
        return None
    if arr.dtype == np.bool_:
        return arr.astype(np.uint32).reshape(-1)
    if np.issubdtype(arr.dtype, np.complexfloating):
        arr = np.ascontiguousarray(np.stack([np.real(arr), np.imag(arr)]))
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}.get(arr.dtype.itemsize)
    if unsigned is None:  # e.g. np.longdouble: no JAX counterpart
        return None
    return arr.view(unsigned).astype(np.uint32).reshape(-1)


# XLA flags that change where a process runs or what it writes, not a program's bits:
# the simulated device count only sizes the CPU thread pool, which bitwise mode's chunk
# programs no longer depend on (unsplit._src.bitwise.canonical_dots).
_BITS_NEUTRAL_FLAGS = ("--xla_force_host_platform_device_count", "--xla_dump")


def bits_settings() -> dict[str, str]:
    """This process's settings that a bitwise step's bits depend on.

    The Bitwise mode guide lists them: https://unsplit.readthedocs.io/en/latest/bitwise/#process-settings-what-must-match

    Processes that must give the same bits -- those of one multi-process job, or
    a run and the one-device run it is compared with -- need equal values:
    the JAX and jaxlib versions, the backend and device kind, and the XLA flags
    (``XLA_FLAGS``, less the simulated device count and dump options), and the
    collectives implementation (:func:`collectives`: the order of the float
    reductions XLA runs across a group's model or sequence axes). The CPU
    thread count (CPUs in the affinity mask, simulated devices) is not one of
    them: a chunk program's dots run on a path that does not split by threads.

    Example:
        >>> from unsplit._src.processes.fingerprint import bits_settings
        >>> settings = bits_settings()
        >>> settings["backend"], {"jax", "jaxlib", "device kind", "xla flags"} <= set(settings)
        ('cpu', True)
    """
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_BITS_NEUTRAL_FLAGS)
    ]
    device = jax.local_devices()[0]
    settings = {
        "jax": jax.__version__,
        "jaxlib": jaxlib.version.__version__,
        "backend": device.platform,
        "device kind": device.device_kind,
        "xla flags": " ".join(sorted(flags)),
        "collectives": collectives(device.platform),
    }
    # The benchmarks' switch back to XLA's reduce-scatter inside FSDP groups changes their bits:
    # a process with it set never agrees with one without.
    if os.environ.get(_BENCH_XLA_GROUP_REDUCE) == "1":
        settings["fsdp group sums"] = f"XLA's ({_BENCH_XLA_GROUP_REDUCE}=1)"
    if os.environ.get(_BENCH_CPU_DEFAULT_LEVEL) == "1":
        settings["cpu programs"] = f"as XLA fuses them ({_BENCH_CPU_DEFAULT_LEVEL}=1)"
    elif os.environ.get(_SUITE_PROCESS_LEVEL) == "1":
        settings["cpu programs"] = f"at the process's level ({_SUITE_PROCESS_LEVEL}=1)"
    return settings


# bitwise/fsdp/group_reduce.py's measuring switch (read there; named here to stay off its floor).
_BENCH_XLA_GROUP_REDUCE = "UNSPLIT_BENCH_XLA_GROUP_REDUCE"
# bitwise/canonical_dots.py's (read there).
_BENCH_CPU_DEFAULT_LEVEL = "UNSPLIT_BENCH_CPU_DEFAULT_LEVEL"
# And the test suite's switch there (its chunk programs at the suite's level).
_SUITE_PROCESS_LEVEL = "UNSPLIT_TEST_CHUNK_PROGRAMS_AT_PROCESS_LEVEL"


# NCCL settings that choose a reduction's algorithm, hence the order of its adds.
_NCCL_ORDER = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")


def collectives(platform: str) -> str:
    """What runs the collectives of XLA's programs here, which fixes their order of adds.

    The float reductions XLA inserts inside a group of devices (a tensor-parallel
    or sequence-parallel layout's all-reduces; an FSDP group's sums are bitwise
    mode's own, in a fixed order) add in the order of the collectives'
    implementation: on CPU the in-process one in a plain process,
    ``jax_cpu_collectives_implementation`` (gloo) under ``jax.distributed``
    (measured, when FSDP groups' sums were XLA's reduce-scatter: relative 1.6e-8);
    on GPU NCCL, whose algorithm ``NCCL_ALGO``/``NCCL_PROTO`` and channels choose
    it (and its topology: see https://unsplit.readthedocs.io/en/latest/bitwise/).

    Example:
        >>> from unsplit._src.processes.fingerprint import collectives
        >>> collectives("cpu")  # a plain process
        'in-process'
    """
    if platform == "cpu":
        if not jax.distributed.is_initialized():
            return "in-process"
        # Config's options are dynamic attributes, which the checker cannot see.
        impl = jax.config.jax_cpu_collectives_implementation  # pyright: ignore[reportAttributeAccessIssue]
        return f"cpu {impl}"
    if platform in ("gpu", "cuda", "rocm"):
        set_ = [f"{k}={os.environ[k]}" for k in _NCCL_ORDER if k in os.environ]
        return " ".join(["nccl", *set_])
    return platform
