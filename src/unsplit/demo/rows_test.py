import jax
import numpy as np

from unsplit.demo import config as demo_config
from unsplit.demo import rows as demo_rows
from unsplit.demo import train as dt


def test_inert_leaves_are_the_key_biases_and_compare_skips_them():
    config = demo_config.make("quick", layers=2)
    _, params, _ = dt.initial_state(config)
    inert = demo_rows.inert_leaves(params)
    assert len(inert) == 2 and all(p.endswith("['key']['bias']") for p in inert)
    leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
    moved = [x.copy() for x in leaves]
    moved[0] = moved[0] + np.float32(0.5)
    curve, everything, same = demo_rows.compare({1: moved}, {1: leaves}, skip={0})
    assert curve == [[1, 0.0]] and everything == 0.5 and not same
    curve, _, same = demo_rows.compare({1: leaves}, {1: leaves})
    assert curve == [[1, 0.0]] and same
