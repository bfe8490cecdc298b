"""One compiled one-device program, loaded onto other devices: compile once, run anywhere.

Every data-parallel group of a bitwise step runs the *same* chunk program, and
its bits are fixed only if each group runs that very program compiled for one
device (the Bitwise mode guide, https://unsplit.readthedocs.io/en/latest/bitwise/). ``jax.jit`` compiles it again for every device
(the device is part of its compile key), so a first call on 8 devices paid for
8 compiles. :func:`relocate` instead takes the program compiled for one device
and loads its executable onto another device (PJRT's
``deserialize_executable`` with that device's assignment): the same machine
code, so the same bits, at the cost of a copy.

A program that spans several devices (a tensor-parallel or FSDP group) is
loaded onto another group's devices the same way, partition ``i`` on the
group's ``i``-th device, and its outputs are put together with the shardings
they had, on the other group's mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import backend as jax_backend


class Relocated:
    """``compiled`` (a one-device :class:`jax.stages.Compiled`) loaded onto ``device``.

    ``compiled`` must take every argument it was lowered with (``jax.jit(fn,
    keep_unused=True)``): the executable is called with all of them.

    Called like ``compiled``, with the same arguments placed on ``device``; its
    outputs live there. ``as_text`` and ``memory_analysis`` are those of the
    program it was loaded from (the same program).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> d0, d1 = jax.devices()[:2]
        >>> compiled = jax.jit(lambda x: x * 2).lower(jax.device_put(jnp.ones(3), d0)).compile()
        >>> program = Relocated(compiled, d1)
        >>> y = program(jax.device_put(jnp.ones(3), d1))
        >>> y.tolist(), y.devices() == {d1}
        ([2.0, 2.0, 2.0], True)
    """

    def __init__(
        self,
        compiled: jax.stages.Compiled,
        device: Any = None,  # a jax.Device
        options: Any = None,
        *,
        mesh: jax.sharding.Mesh | None = None,
    ):
        # One device (``device``), or a group of devices (``mesh``: the other group's mesh,
        # its devices in the order of the compiled program's partitions).
        self.compiled = compiled
        if mesh is None and device is None:
            raise ValueError("Relocated needs a device or a mesh; got neither.")
        self.devices = list(mesh.devices.flat) if mesh is not None else [device]
        self.device = self.devices[0]
        compile_options = jax_backend.get_compile_options(
            num_replicas=1,
            num_partitions=len(self.devices),
            device_assignment=np.array([[d.id for d in self.devices]]),
            env_options_overrides=options,
        )
        runtime: Any = compiled.runtime_executable()  # always set on a compiled program
        self.executable = self.device.client.deserialize_executable(
            runtime.serialize(),
            executable_devices=self.devices,
            compile_options=compile_options,
        )
        self.in_tree = compiled.in_tree
        self.out_tree = compiled.out_tree
        self._keys: dict[int, tuple] = {}  # the data of the keys passed last, by position
        self.outputs = None
        if mesh is not None:  # each output as a global array of the other group's mesh
            shardings = jax.tree.leaves(compiled.output_shardings)
            if not all(isinstance(s, jax.sharding.NamedSharding) for s in shardings):
                raise TypeError("only outputs with NamedShardings can be put together")
            shapes = [x.shape for x in jax.tree.leaves(compiled.out_info)]
            self.outputs = [
                (shape, jax.sharding.NamedSharding(mesh, s.spec))
                for shape, s in zip(shapes, shardings, strict=True)
            ]

    def __call__(self, *args: Any) -> Any:
        leaves, tree = jax.tree.flatten((args, {}))
        if tree != self.in_tree:
            raise TypeError(f"expected arguments {self.in_tree}; got {tree}")
        leaves = [_buffer(x, self.device, self._keys, i) for i, x in enumerate(leaves)]
        outs = self.executable.execute_sharded(leaves).disassemble_into_single_device_arrays()
        if self.outputs is None:
            return jax.tree.unflatten(self.out_tree, [out[0] for out in outs])
        arrays = [
            jax.make_array_from_single_device_arrays(shape, sharding, pieces)
            for (shape, sharding), pieces in zip(self.outputs, outs, strict=True)
        ]
        return jax.tree.unflatten(self.out_tree, arrays)

    def as_text(self) -> str:
        return self.compiled.as_text() or ""

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()


class Replicas:
    """``compiled`` (a one-device program) loaded as a program of one replica per device of
    ``devices``: **one** launch runs it on every device, each on its own inputs, with the
    same machine code, so each device gets the bits the one-device program gives there.

    Called with each device's arguments (as ``compiled`` takes them), returns each device's
    outputs. For a small program (an optimizer update) one launch costs a third of the host
    time of one launch per device (:class:`Relocated`; 8 simulated CPU devices: 0.55 ms vs
    1.8 ms). XLA's CPU runtime runs a many-replica launch before it returns, so a program
    with real compute (a chunk program) gains nothing: the host waits for it.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> d0, d1 = jax.devices()[:2]
        >>> one = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=jax.sharding.make_single_device_sharding(d0))
        >>> program = Replicas(jax.jit(lambda w: w * 2).lower(one).compile(), [d0, d1])
        >>> a, b = program([(jax.device_put(jnp.ones(3), d0),), (jax.device_put(jnp.arange(3.0), d1),)])
        >>> a.tolist(), b.tolist(), b.devices() == {d1}
        ([2.0, 2.0, 2.0], [0.0, 2.0, 4.0], True)
    """

    def __init__(self, compiled: jax.stages.Compiled, devices: list, options: Any = None):
        self.devices = list(devices)
        compile_options = jax_backend.get_compile_options(
            num_replicas=len(self.devices),
            num_partitions=1,
            device_assignment=np.array([[d.id] for d in self.devices]),
            env_options_overrides=options,
        )
        runtime: Any = compiled.runtime_executable()  # always set on a compiled program
        self.executable = self.devices[0].client.deserialize_executable(
            runtime.serialize(), executable_devices=self.devices, compile_options=compile_options
        )
        # Each argument travels as one array whose device i holds device i's value.
        self.sharding = jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(self.devices), ("_replicas",)), jax.P()
        )
        self.in_tree, self.out_tree = compiled.in_tree, compiled.out_tree

    def __call__(self, per_device: list[tuple]) -> list[Any]:
        flat = []
        for args in per_device:
            leaves, tree = jax.tree.flatten((tuple(args), {}))
            if tree != self.in_tree:
                raise TypeError(f"expected arguments {self.in_tree}; got {tree}")
            flat.append(leaves)
        columns = zip(
            *(
                [_buffer(x, d) for x in leaves]
                for leaves, d in zip(flat, self.devices, strict=True)
            ),
            strict=True,
        )
        arrays = [
            jax.make_array_from_single_device_arrays(pieces[0].shape, self.sharding, list(pieces))
            for pieces in columns
        ]
        outs = self.execute(arrays)
        return [
            jax.tree.unflatten(self.out_tree, [out[i] for out in outs])
            for i in range(len(self.devices))
        ]

    def execute(self, arrays: Sequence[jax.Array]) -> list[list]:
        """Arrays whose device ``i`` holds device ``i``'s argument (in ``in_tree``'s order;
        each of this process's buffers on :attr:`devices`, in their order) -> each output
        leaf's per-device arrays."""
        return self.executable.execute_sharded(arrays).disassemble_into_single_device_arrays()


class OnEveryDevice:
    """A jitted function of pytrees run on every device of ``mesh`` when every leaf is
    replicated on it: each device computes on its own copy and keeps its result, so the
    outputs are replicated with no gather onto one device and no copy back. The optimizer
    update of replicated params (LoRA adapters).

    Its bits are the one-device program's (compiled for ``device``) on every device. It runs
    as the SPMD program ``jax.jit`` compiles for the replicated leaves (XLA's partitioner
    leaves a program of replicated values as it is; one asynchronous launch, half the time
    of the replicas below on 8 CPU devices) once that program is seen to give the
    one-device program's bits, leaf for leaf, on random inputs of the signature (each float
    leaf drawn from a fixed seed: a product fused otherwise, another vector loop or another
    reduction order would show in every leaf of more than a few elements); else as
    :class:`Replicas` of the one-device program's machine code.
    :attr:`verified` holds the outcome per input signature.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> mesh = jax.make_mesh((2,), ("data",))
        >>> w = jax.device_put(jnp.arange(3.0), jax.NamedSharding(mesh, jax.P()))
        >>> double = OnEveryDevice(jax.jit(lambda w: (w * 2,)), mesh, jax.devices()[0])
        >>> double.accepts((w,))
        True
        >>> (out,) = double((w,), like=(w,))
        >>> out.tolist(), out.sharding == w.sharding
        ([0.0, 2.0, 4.0], True)
    """

    def __init__(self, jitted: Any, mesh: jax.sharding.Mesh, device: Any):
        self.jitted, self.mesh = jitted, mesh
        self.device = jax.sharding.make_single_device_sharding(device)
        me = jax.process_index()
        self.devices = [d for d in mesh.devices.flat if d.process_index == me]
        self.whole = jax.sharding.NamedSharding(mesh, jax.P())
        self._programs: dict[Any, tuple[Any, list]] = {}
        self.verified: dict[Any, bool] = {}  # signature -> the SPMD program gave the bits

    def accepts(self, trees: Any) -> bool:
        """Whether every leaf is an array (no key) replicated on the mesh of several devices."""
        return self.mesh.size > 1 and all(map(self._replica, jax.tree.leaves(trees)))

    def _replica(self, x: Any) -> bool:
        sharding = getattr(x, "sharding", None)
        return (
            isinstance(sharding, jax.sharding.NamedSharding)
            and sharding.mesh == self.mesh
            and sharding.is_fully_replicated
            and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
        )

    def __call__(self, trees: tuple, like: Any = None) -> Any:
        """``fn(*trees)``; its outputs get the shardings of ``like``'s leaves (the inputs
        they replace), else ``P()`` on the mesh."""
        leaves, treedef = jax.tree.flatten(trees)
        signature = (treedef, tuple((x.shape, x.dtype) for x in leaves))
        if signature not in self._programs:
            self._programs[signature] = self._compile(signature, leaves, treedef, like)
        program, shardings = self._programs[signature]
        if not isinstance(program, Replicas):
            with jax.set_mesh(None):  # its shardings name the mesh; not the caller's set_mesh
                return program(*trees)
        # A replicated leaf holds one buffer per device of the mesh, in the mesh's order (this
        # process's devices): as the replicas take their arguments, so it goes in as it is.
        outs = program.execute(leaves)
        arrays = [
            jax.make_array_from_single_device_arrays(shape, sharding, pieces)
            for pieces, (shape, sharding) in zip(outs, shardings, strict=True)
        ]
        return jax.tree.unflatten(program.out_tree, arrays)

    def _compile(self, signature, leaves: list, treedef, like: Any) -> tuple[Any, list]:
        """The SPMD program if it gives the one-device program's bits, else the replicas;
        with the outputs' (shape, sharding)."""
        one = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.device) for x in leaves]
        compiled = self.jitted.lower(*jax.tree.unflatten(treedef, one)).compile()
        shapes = [x.shape for x in jax.tree.leaves(compiled.out_info)]
        shardings = [x.sharding for x in jax.tree.leaves(like)]
        if len(shardings) != len(shapes):
            shardings = [self.whole] * len(shapes)
        fn = getattr(self.jitted, "__wrapped__", self.jitted)  # the function, jitted once
        spmd = jax.jit(fn, out_shardings=jax.tree.unflatten(compiled.out_tree, shardings))
        outputs = list(zip(shapes, shardings, strict=True))
        same = _same_bits(compiled, spmd, leaves, treedef, self.device, self.whole)
        self.verified[signature] = same
        return (spmd if same else Replicas(compiled, self.devices)), outputs


def _same_bits(compiled, spmd, leaves: list, treedef, device, whole) -> bool:
    """Do the one-device program and the SPMD one give the same bits on random inputs of
    these leaves' shapes and dtypes (floats from a fixed seed in [0.5, 2): no NaN from a
    root or a log of the draw; other leaves as they are)?"""
    rng = np.random.default_rng(0)
    drawn = []
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.floating):
            drawn.append(rng.uniform(0.5, 2.0, x.shape).astype(x.dtype))
        else:
            drawn.append(np.asarray(jax.device_get(x.addressable_data(0))))
    one = compiled(*jax.tree.unflatten(treedef, [jax.device_put(v, device) for v in drawn]))
    with jax.set_mesh(None):
        many = spmd(*jax.tree.unflatten(treedef, [jax.device_put(v, whole) for v in drawn]))
    return all(
        _bits(a) == _bits(shard.data)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many), strict=True)
        for shard in b.addressable_shards
    )


def _bits(x: jax.Array) -> bytes:
    return np.asarray(jax.device_get(x)).tobytes()


def _buffer(x: Any, device: Any, keys: dict | None = None, at: int = 0) -> jax.Array:
    """An argument as the executable takes it: an array on ``device``; a key as its data.

    ``keys`` (argument position ``at`` -> ``(key, data)``) keeps the data of a key passed
    again at the same position (a frozen NNX model's stream keys: a dispatched op per key
    per call otherwise, 0.2 ms each on a loaded CPU)."""
    if isinstance(x, jax.Array) and isinstance(x.dtype, np.dtype):
        return x  # the common case, without jnp.issubdtype's host time
    if not isinstance(x, jax.Array):
        x = jax.device_put(x, device)
    if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    held = keys.get(at) if keys is not None else None
    if held is not None and held[0] is x:
        return held[1]
    data = jax.random.key_data(x)
    if keys is not None:
        keys[at] = (x, data)
    return data
