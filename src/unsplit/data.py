"""Topology-free data order for elastic runs, on grain.

``global_steps(dataset, global_batch=B, seed=S, mesh=mesh)`` defines the
records of every global step from ``(seed, epoch, step)`` alone and gives each
process only its own rows of each step, with their record indices as global
ids. The data position is the step number. See the Elastic runs guide:
https://unsplit.readthedocs.io/en/latest/elastic/

Example:
    >>> import numpy as np, unsplit
    >>> steps = unsplit.data.global_steps(np.arange(12), global_batch=4, seed=7)
    >>> rows, ids = steps[5]            # this process's rows of global step 5
    >>> steps.epoch(5), rows.shape, bool((rows == ids).all())
    (1, (4,), True)
"""

from unsplit._src.extras import require

require("grain", extra="data", what="unsplit.data")

from unsplit._src.elastic.data import DataSettings as DataSettings
from unsplit._src.elastic.data import GlobalSteps as GlobalSteps
from unsplit._src.elastic.data import global_steps as global_steps

__all__ = ["DataSettings", "GlobalSteps", "global_steps"]
