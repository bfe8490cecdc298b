"""One compiled one-device program, loaded onto other devices: compile once, run anywhere.

Every data-parallel group of a bitwise step runs the *same* chunk program, and
its bits are fixed only if each group runs that very program compiled for one
device (``docs/bitwise.md``). ``jax.jit`` compiles it again for every device
(the device is part of its compile key), so a first call on 8 devices paid for
8 compiles. :func:`relocate` instead takes the program compiled for one device
and loads its executable onto another device (PJRT's
``deserialize_executable`` with that device's assignment): the same machine
code, so the same bits, at the cost of a copy.

Only one-device programs are relocated; a program that spans several devices
(a tensor-parallel group) is compiled for its devices as before.
"""

from __future__ import annotations

from typing import Any

import jax
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

    def __init__(self, compiled: jax.stages.Compiled, device: jax.Device, options: Any = None):
        self.compiled = compiled
        self.device = device
        compile_options = jax_backend.get_compile_options(
            num_replicas=1,
            num_partitions=1,
            device_assignment=np.array([[device.id]]),
            env_options_overrides=options,
        )
        self.executable = device.client.deserialize_executable(
            compiled.runtime_executable().serialize(),
            executable_devices=[device],
            compile_options=compile_options,
        )
        self.in_tree = compiled.in_tree
        self.out_tree = compiled.out_tree

    def __call__(self, *args: Any) -> Any:
        leaves, tree = jax.tree.flatten((args, {}))
        if tree != self.in_tree:
            raise TypeError(f"expected arguments {self.in_tree}; got {tree}")
        leaves = [_buffer(x, self.device) for x in leaves]
        outs = self.executable.execute_sharded(leaves).disassemble_into_single_device_arrays()
        return jax.tree.unflatten(self.out_tree, [out[0] for out in outs])

    def as_text(self) -> str:
        return self.compiled.as_text()

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()


def _buffer(x: Any, device: jax.Device) -> jax.Array:
    """An argument as the executable takes it: an array on ``device``; a key as its data."""
    if not isinstance(x, jax.Array):
        x = jax.device_put(x, device)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return x
