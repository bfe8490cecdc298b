"""examples/train_lora.py: adapters on a frozen FSDP base; the curve does not depend on the schedule."""

import example_scripts
import pytest

pytestmark = pytest.mark.usefixtures("standard_promotion")  # user code (optax)


@pytest.fixture(scope="module")
def train_lora():
    with example_scripts.loaded("train_lora") as module:
        yield module


@pytest.mark.parametrize("bitwise", [[], ["--bitwise"]])
def test_devices_and_microbatches_give_the_one_device_curve(train_lora, capsys, bitwise):
    assert train_lora.main(["--devices", "4", "--microbatches", "2", "--steps", "2", *bitwise]) == 0
    out = capsys.readouterr().out
    assert "bit-identical curves: True" in out or not bitwise
    assert "largest relative difference" in out


def test_a_batch_that_does_not_split_is_refused(train_lora, capsys):
    assert train_lora.main(["--batch", "30", "--devices", "4"]) == 2
    assert "must be a multiple" in capsys.readouterr().err
