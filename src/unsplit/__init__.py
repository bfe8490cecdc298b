"""unsplit: one training step, whatever the schedule.

Every example's randomness comes from its global id (``fold_in(key, id)``),
losses are normalized over the global batch, and an optional bitwise mode fixes
every reduction order, so a step gives the same loss and gradients on 1 device,
on N devices, or as k gradient-accumulation microbatches.

For a whole run, :mod:`unsplit.data` defines which records form every global
step whatever the topology (on grain), and :mod:`unsplit.checkpoint` saves and
restores the run onto any mesh and process count (with orbax).
"""

from unsplit import checkpoint as checkpoint
from unsplit import data as data
from unsplit import equinox as equinox
from unsplit import linen as linen
from unsplit import models as models
from unsplit import nnx as nnx
from unsplit import testing as testing
from unsplit._src.audit.api import audit as audit
from unsplit._src.audit.api import audit_step as audit_step
from unsplit._src.audit.finding import AuditError as AuditError
from unsplit._src.audit.finding import Finding as Finding
from unsplit._src.dropout.functional import dropout as dropout
from unsplit._src.keys import Ids64 as Ids64
from unsplit._src.keys import example_keys as example_keys
from unsplit._src.keys import ids64 as ids64
from unsplit._src.processes.agreement import AgreementError as AgreementError
from unsplit._src.processes.global_batch import global_batch as global_batch
from unsplit._src.step.state_guard import DroppedStateError as DroppedStateError
from unsplit._src.train_step import bitwise_train_step as bitwise_train_step
from unsplit._src.train_step import train_step as train_step
from unsplit._src.value_and_grad import Step as Step
from unsplit._src.value_and_grad import value_and_grad as value_and_grad

__version__ = "0.1.0"

__all__ = [
    "AgreementError",
    "AuditError",
    "DroppedStateError",
    "Finding",
    "Ids64",
    "Step",
    "audit",
    "audit_step",
    "bitwise_train_step",
    "checkpoint",
    "data",
    "dropout",
    "equinox",
    "example_keys",
    "global_batch",
    "ids64",
    "linen",
    "models",
    "nnx",
    "testing",
    "train_step",
    "value_and_grad",
]
