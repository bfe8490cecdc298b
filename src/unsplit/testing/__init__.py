"""Test a training step on several local JAX processes, as unsplit's own tests do.

``bits_equal(a, b)`` compares two pytrees bit for bit (what bitwise mode
promises across schedules); ``rel_l2(a, b)`` is their relative distance (what
default mode keeps at float-rounding size). ``bytes_sent(compiled)`` is what a
compiled program's collectives send per device, counted from its HLO as ring
algorithms send them; ``bitwise_cost(step, params, batch, key)`` is what a bitwise
step holds and sends per device, read from all of its compiled programs (default mode's
one program answers ``step.lower(...).compile().memory_analysis()``).

``run_local_processes`` starts ``num_processes`` Python processes on this
machine, each with ``devices_per_process`` simulated CPU devices, joined by
``jax.distributed`` over gloo on 127.0.0.1. Each runs ``module:function(**kwargs)``
and sends back its JSON-serializable result. Time is bounded, and every process
is killed on failure, timeout or interrupt: a process that raises or dies ends
the others within seconds, with a :class:`LaunchError` naming it.

Each process runs ``python -m unsplit.testing --target MOD:FN --process-id I
--num-processes N --port P --kwargs JSON --out FILE`` (the worker entry). A
worker whose function raises exits at once instead of waiting for its peers in
``jax.distributed``'s shutdown barrier, and its heartbeat timeout is 10 s, so
a dead peer also ends the others without the launcher. See the Testing on several
processes guide (https://unsplit.readthedocs.io/en/latest/testing/) for
a test of your own step and for the ``jax.distributed.initialize`` settings
that end every process when one fails.

Example:
    >>> import unsplit.testing
    >>> results = unsplit.testing.run_local_processes(  # doctest: +SKIP
    ...     "unsplit._src.processes.launch:describe", num_processes=2, devices_per_process=2)
    >>> [r["process_index"] for r in results]  # doctest: +SKIP
    [0, 1]
"""

from unsplit._src.bitwise.cost import BitwiseCost as BitwiseCost
from unsplit._src.bitwise.cost import bitwise_cost as bitwise_cost
from unsplit._src.bitwise.traffic import bytes_sent as bytes_sent
from unsplit._src.front.replay import digests as digests
from unsplit._src.processes.launch import LaunchError as LaunchError
from unsplit._src.processes.launch import free_port as free_port
from unsplit._src.processes.launch import run_local_processes as run_local_processes
from unsplit._src.trees import bits_equal as bits_equal
from unsplit._src.trees import rel_l2 as rel_l2

__all__ = [
    "BitwiseCost",
    "LaunchError",
    "bits_equal",
    "bitwise_cost",
    "bytes_sent",
    "digests",
    "free_port",
    "rel_l2",
    "run_local_processes",
]
