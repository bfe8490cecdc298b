"""unsplit: one training step, whatever the schedule.

Every example's randomness comes from its global id (``fold_in(key, id)``),
losses are normalized over the global batch, and an optional bitwise mode fixes
every reduction order, so a step gives the same loss and gradients on 1 device,
on N devices, or as k gradient-accumulation microbatches.

For a whole run, :mod:`unsplit.data` defines which records form every global
step whatever the topology (on grain), and :mod:`unsplit.checkpoint` saves and
restores the run onto any mesh and process count (with orbax).

``pip install unsplit`` needs only JAX, NumPy, optax and rich. The integrations
are extras, imported on first use: ``unsplit.linen``, ``unsplit.nnx`` and
``unsplit.models`` (``unsplit[flax]``), ``unsplit.equinox`` (``unsplit[equinox]``),
``unsplit.data`` (``unsplit[data]``: grain), ``unsplit.checkpoint``
(``unsplit[checkpoint]``: orbax); without its library, a module raises an
ImportError naming the extra.
"""

import importlib as _importlib

from unsplit import testing as testing
from unsplit._src.audit.api import audit as audit
from unsplit._src.audit.api import audit_step as audit_step
from unsplit._src.audit.finding import AuditError as AuditError
from unsplit._src.audit.finding import Finding as Finding
from unsplit._src.audit.finding import PaddingWarning as PaddingWarning
from unsplit._src.bitwise.canonical_sum import canonical_sum as canonical_sum
from unsplit._src.bitwise.chunk_size import chunk_size_for as chunk_size_for
from unsplit._src.dropout.functional import dropout as dropout
from unsplit._src.front.options import Bitwise as Bitwise
from unsplit._src.front.replay import ReplayReport as ReplayReport
from unsplit._src.front.replay import StepRecord as StepRecord
from unsplit._src.front.replay import record_step as record_step
from unsplit._src.front.replay import replay_step as replay_step
from unsplit._src.front.train_step import bitwise_train_step as bitwise_train_step
from unsplit._src.front.train_step import train_step as train_step
from unsplit._src.front.train_step import trainable as trainable
from unsplit._src.front.value_and_grad import Step as Step
from unsplit._src.front.value_and_grad import value_and_grad as value_and_grad
from unsplit._src.keys import Ids64 as Ids64
from unsplit._src.keys import example_keys as example_keys
from unsplit._src.keys import ids64 as ids64
from unsplit._src.processes.agreement import AgreementError as AgreementError
from unsplit._src.processes.global_batch import global_batch as global_batch
from unsplit._src.processes.mesh import mesh_over as mesh_over
from unsplit._src.ring.attention import ring_attention as ring_attention
from unsplit._src.step.state_guard import DroppedStateError as DroppedStateError

__version__ = "0.1.0"

#: Integrations, imported on first access (each needs an extra; see the module docstring).
_INTEGRATIONS = ("checkpoint", "data", "equinox", "linen", "models", "nnx")


def __getattr__(name: str):
    if name in _INTEGRATIONS:
        return _importlib.import_module(f"unsplit.{name}")
    raise AttributeError(f"module 'unsplit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_INTEGRATIONS})


__all__ = [
    "AgreementError",
    "AuditError",
    "Bitwise",
    "DroppedStateError",
    "Finding",
    "Ids64",
    "PaddingWarning",
    "ReplayReport",
    "Step",
    "StepRecord",
    "audit",
    "audit_step",
    "bitwise_train_step",
    "canonical_sum",
    "chunk_size_for",
    "dropout",
    "example_keys",
    "global_batch",
    "ids64",
    "mesh_over",
    "record_step",
    "replay_step",
    "ring_attention",
    "testing",
    "train_step",
    "trainable",
    "value_and_grad",
]
