"""A bitwise run that changes its tensor-parallel degree mid-run, through a checkpoint.

Three AdamW steps at (data=4, model=2), a checkpoint written through the host (orbax),
restored at (data=1, model=8), three more steps: the params and optimizer state equal,
bit for bit, those of the same six steps on a one-device layout (a mesh whose model axis
has one device, computed at degree 2) -- the whole run, optimizer included, does not
depend on the model-parallel degree.
"""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import unsplit
from unsplit import models

pytestmark = pytest.mark.usefixtures("standard_promotion")  # optax mixes floats and int32

CONFIG = models.TransformerConfig(vocab=32, length=8, width=32, heads=16, layers=1)
MODEL = models.Transformer(CONFIG)
PARAMS = models.init_params(MODEL)
LOSS = models.token_loss(MODEL)
KEY = jax.random.key(5)
STEPS = 6


def batches():
    return [
        jax.tree.map(np.asarray, models.synthetic_batch(CONFIG, 16, seed=s)) for s in range(STEPS)
    ]


def layout(data, model):
    mesh = jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[: data * model])  # fmt: skip
    specs = models.megatron_specs(PARAMS)
    step = unsplit.value_and_grad(
        LOSS, weighted=True, mesh=mesh, bitwise=unsplit.Bitwise(chunk_size=4)
    )
    return mesh, specs, unsplit.train_step(step, optax.adamw(1e-2))


def placed(data, model, state):
    """``state`` (host values) on the layout's mesh: params with Megatron's specs, the
    optimizer state as optax's init makes it for them."""
    mesh, specs, _ = layout(data, model)
    params = models.on_mesh(jax.device_get(state[0]), mesh, specs)
    like = jax.jit(optax.adamw(1e-2).init)(params)
    opt_state = jax.tree.map(lambda x, y: jax.device_put(y, x.sharding), like, state[1])
    return params, opt_state


def run(state, data, model, steps):
    _, _, train = layout(data, model)
    params, opt_state = state
    for s in steps:
        _, params, opt_state = train(params, opt_state, batches()[s], jax.random.fold_in(KEY, s))
    return params, opt_state


def test_a_run_that_changes_degree_mid_run_ends_in_the_one_device_runs_bits(tmp_path):
    start = (PARAMS, optax.adamw(1e-2).init(PARAMS))
    whole = jax.device_get(run(placed(1, 1, start), 1, 1, range(STEPS)))
    first = run(placed(4, 2, start), 4, 2, range(3))
    settings = {"chunk_size": 4, "blocks": 8}
    with unsplit.checkpoint.Checkpointer(tmp_path, settings=settings) as ckpt:
        ckpt.save(3, {"params": first[0], "opt": first[1]})
    params8, opt8 = placed(1, 8, start)  # where the run resumes: another degree
    with unsplit.checkpoint.Checkpointer(tmp_path, settings=settings) as ckpt:
        step, restored = ckpt.restore(like={"params": params8, "opt": opt8})
    assert step == 3
    resumed = jax.device_get(run((restored["params"], restored["opt"]), 1, 8, range(3, STEPS)))
    assert unsplit.testing.bits_equal(resumed, whole)
