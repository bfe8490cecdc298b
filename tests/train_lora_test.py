"""examples/train_lora.py: adapters on a frozen FSDP base; the curve does not depend on the schedule."""

import importlib.util
import pathlib
import sys

import jax
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_lora.py"


@pytest.fixture(autouse=True)
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # user code (optax), not the tests' strict mode
        yield


@pytest.fixture(scope="module")
def train_lora():
    spec = importlib.util.spec_from_file_location("train_lora", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lora"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("train_lora", None)


@pytest.mark.parametrize("bitwise", [[], ["--bitwise"]])
def test_devices_and_microbatches_give_the_one_device_curve(train_lora, capsys, bitwise):
    assert train_lora.main(["--devices", "4", "--microbatches", "2", "--steps", "2", *bitwise]) == 0
    out = capsys.readouterr().out
    assert "bit-identical curves: True" in out or not bitwise
    assert "largest relative difference" in out


def test_a_batch_that_does_not_split_is_refused(train_lora, capsys):
    assert train_lora.main(["--batch", "30", "--devices", "4"]) == 2
    assert "must be a multiple" in capsys.readouterr().err
