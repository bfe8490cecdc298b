"""An elastic training run: the demo's model and data, grain's data order, orbax checkpoints.

The pieces ``examples/train_lm.py`` and the demo's elastic row share:

* :class:`ElasticConfig`: model size, optimizer, seed, global batch, mode;
  :meth:`ElasticConfig.settings` are the values a resumed run must keep;
* :func:`setup`: on a given mesh, the model and its token-weighted loss, the
  data (:func:`unsplit.data.global_steps` over :class:`~unsplit.demo.data.Windows`),
  the unsplit step, Adam and the initial state, replicated over the mesh;
* :func:`train_step`: the one per-step update ``(params, opt_state, batch,
  key, ids) -> (loss, params, opt_state)``;
* :func:`global_step`: global step ``s`` from start to end: this process's
  rows, assembled into the global batch, the step key ``fold_in(seed, s)``.

A run is then a loop over global steps that saves ``(params, opt_state)``
with the step every few steps; whatever the topology, step ``s`` reads the
same records with the same ids and key, so a run resumed on other devices or
processes continues the same computation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit import models
from unsplit.demo import config as demo_config
from unsplit.demo import data as demo_data


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """What an elastic run trains; every field but ``microbatches`` fixes the result."""

    global_batch: int = 16
    length: int = 32
    width: int = 64
    layers: int = 2
    heads: int = 4
    dropout: float = 0.1
    learning_rate: float = 3e-3
    seed: int = 0
    bitwise: bool = False
    chunk_size: int | None = None  # bitwise mode's unit of work; default 1 (any schedule)
    microbatches: int = 1  # schedule only: may change on resume

    def model(self) -> models.Transformer:
        return demo_config.transformer(self)

    def effective_chunk_size(self) -> int | None:
        """The chunk size bitwise mode uses (None in default mode)."""
        if not self.bitwise:
            return None
        # One example per chunk lets a run resume on any schedule whose shares divide the
        # batch. Passed explicitly to the step, so the saved value is the one in use.
        return self.chunk_size or 1

    def settings(self, records: int) -> dict[str, Any]:
        """The values a resumed run must keep (checked by ``unsplit.checkpoint``).

        Seed, global batch and the dataset's size fix each step's records and
        noise; the model, optimizer and mode fix the function; in bitwise mode
        the chunk size and JAX's version fix the bits.
        """
        fixed = dataclasses.asdict(self)
        del fixed["microbatches"]
        fixed["chunk_size"] = self.effective_chunk_size()
        fixed["records"] = int(records)
        return unsplit.checkpoint.run_settings(fixed, bitwise=self.bitwise)


@dataclasses.dataclass
class Setup:
    """Everything a run needs on one mesh (see :func:`setup`)."""

    config: ElasticConfig
    mesh: jax.sharding.Mesh
    steps: unsplit.data.GlobalSteps
    step: unsplit.Step
    optimizer: optax.GradientTransformation
    params: Any
    opt_state: Any
    settings: dict[str, Any]


def setup(config: ElasticConfig, mesh: jax.sharding.Mesh, source: Any = None) -> Setup:
    """The model, data, step, optimizer and initial state of ``config`` on ``mesh``.

    ``source`` is the record source (default: the demo's text as
    :class:`~unsplit.demo.data.Windows` of ``config.length``).
    """
    source = demo_data.Windows(config.length) if source is None else source
    steps = unsplit.data.global_steps(
        source, global_batch=config.global_batch, seed=config.seed, mesh=mesh
    )
    model = config.model()
    step = unsplit.value_and_grad(
        models.token_loss(model),
        weighted=True,
        microbatches=config.microbatches,
        mesh=mesh,
        bitwise=config.bitwise,
        chunk_size=config.effective_chunk_size(),
    )
    optimizer = optax.adam(config.learning_rate)
    params = jax.device_get(models.init_params(model, config.seed))
    opt_state = jax.device_get(optimizer.init(params))
    return Setup(
        config=config,
        mesh=mesh,
        steps=steps,
        step=step,
        optimizer=optimizer,
        params=replicate(params, mesh),
        opt_state=replicate(opt_state, mesh),
        settings=config.settings(steps.settings.records),
    )


def replicate(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Host values as arrays replicated on every device of ``mesh`` (any process count)."""
    sharding = NamedSharding(mesh, P())

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    # Through a jit, so the arrays carry the mesh in their type exactly as the optimizer
    # update's outputs do; otherwise the step's programs compile again at the second step.
    return jax.jit(lambda t: t, out_shardings=sharding)(jax.tree.map(one, tree))


def train_step(step: unsplit.Step, optimizer: optax.GradientTransformation):
    """The per-step update: ``train(params, opt_state, batch, key, ids) -> (loss, params, opt_state)``.

    :func:`unsplit.bitwise_train_step`: in default mode the whole update (step
    and Adam) is one jitted program; bitwise mode runs the step's fixed chunk
    programs, then Adam's update as one program. Params and optimizer state
    are donated either way.
    """
    train = unsplit.bitwise_train_step(step, optimizer)

    def update(params, opt_state, batch, key, ids):
        return train(params, opt_state, batch, key, ids=ids)

    return update


def global_step(run: Setup, s: int) -> tuple[Any, Any, jax.Array]:
    """Global step ``s``'s batch, ids and key: ``(batch, ids, fold_in(key(seed), s))``.

    This process reads only its own rows (``run.steps[s]``); ``global_batch``
    assembles every process's rows with their record ids.
    """
    rows, ids = run.steps[s]
    batch, ids = unsplit.global_batch(rows, run.mesh, ids)
    return batch, ids, jax.random.fold_in(jax.random.key(run.config.seed), s)


def host_params(params: Any) -> dict[str, np.ndarray]:
    """Replicated params as host arrays keyed by their tree path (``jax.tree_util.keystr``)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(p): np.asarray(x.addressable_data(0)) for p, x in flat}


def inert(path: str) -> bool:
    """Attention key biases: softmax ignores them, so their gradient is 0 up to rounding."""
    return path.endswith("['key']['bias']")
