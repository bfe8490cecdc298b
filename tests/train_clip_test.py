"""examples/train_clip.py: the contrastive loss curve does not depend on the schedule."""

import os

import example_scripts
import pytest

pytestmark = pytest.mark.usefixtures("standard_promotion")  # user code (optax)


@pytest.fixture(scope="module")
def train_clip():
    with example_scripts.loaded("train_clip") as module:
        yield module


@pytest.mark.parametrize("bitwise", [[], ["--bitwise"]])
def test_devices_and_microbatches_give_the_one_device_curve(train_clip, capsys, bitwise):
    assert train_clip.main(["--devices", "4", "--microbatches", "2", "--steps", "3", *bitwise]) == 0
    out = capsys.readouterr().out
    assert "bit-identical curves: True" in out or not bitwise
    assert "largest relative difference" in out


@pytest.mark.multiprocess
def test_two_processes_give_the_one_device_curve(train_clip, capsys, monkeypatch):
    # The workers import the example by name, and unsplit from where this process has it.
    path = [str(example_scripts.EXAMPLES), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, path)))
    argv = ["--devices", "2", "--processes", "2", "--microbatches", "1", "--steps", "2"]
    assert train_clip.main(argv) == 0
    assert "largest relative difference" in capsys.readouterr().out


def test_a_batch_that_does_not_split_is_refused(train_clip, capsys):
    assert train_clip.main(["--batch", "30", "--devices", "4"]) == 2
    assert "must be a multiple" in capsys.readouterr().err
