"""Checkpoints of an elastic run, with orbax: save on one topology, resume on another.

``Checkpointer(directory, settings={...})`` saves the training state, the
global step (the data position of :func:`unsplit.data.global_steps`) and the
run's invariance settings; ``restore(like=state)`` reads the state onto this
run's mesh and processes after checking the settings. See the Elastic runs guide:
https://unsplit.readthedocs.io/en/latest/elastic/
"""

from unsplit._src.extras import require

require("orbax.checkpoint", extra="checkpoint", what="unsplit.checkpoint")

from unsplit._src.elastic.checkpoint import Checkpointer as Checkpointer
from unsplit._src.elastic.checkpoint import SettingsMismatch as SettingsMismatch
from unsplit._src.elastic.checkpoint import run_settings as run_settings

__all__ = ["Checkpointer", "SettingsMismatch", "run_settings"]
