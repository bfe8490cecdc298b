"""The demo's arguments (moving to cli_test.py)."""

import os

import pytest

from unsplit import cli

# ---- the demo's arguments: refused before any work, argparse style --------------------


def _demo_error(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *argv])
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "-1"], "argument --seed: seed must be in [0, 2**63 - 1] (an integer); got -1"),
        (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
        (["--learning-rate", "nan"], "argument --learning-rate: learning_rate must be > 0 and "
         "finite; got nan"),
        (["--learning-rate", "inf"], "learning_rate must be > 0 and finite; got inf"),
        (["--learning-rate", "0"], "learning_rate must be > 0 and finite; got 0"),
        (["--dropout", "nan"], "argument --dropout: dropout must be in (0, 1); got nan"),
        (["--dropout", "1"], "dropout must be in (0, 1); got 1"),
        (["--steps", "0"], "argument --steps: steps must be >= 2 (an integer); got 0"),
        (["--batch-size", "-8"], "argument --batch-size: batch_size must be >= 8 (an integer); "
         "got -8"),
        (["--length", "2"], "argument --length: length must be >= 4 (an integer); got 2"),
        (["--width", "0"], "argument --width: width must be >= 1 (an integer); got 0"),
        (["--layers", "-1"], "argument --layers: layers must be >= 1 (an integer); got -1"),
        (["--heads", "0"], "argument --heads: heads must be >= 1 (an integer); got 0"),
        (["--plot", "out.txt"], "--plot out.txt: matplotlib cannot write '.txt' files"),
    ],
)  # fmt: skip
def test_bad_demo_arguments_fail_before_any_work(capsys, argv, message):
    assert message in _demo_error(capsys, *argv)


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_unwritable_output_paths_fail_before_any_work(capsys, option):
    # /proc refuses new files even to root, so this holds whoever runs the tests.
    path = "/proc/unsplit-out.png"
    err = _demo_error(capsys, option, path)
    assert f"{option} {path}: cannot write there" in err and "Fix:" in err


def test_json_and_plot_must_be_different_files(capsys, tmp_path):
    path = str(tmp_path / "out.png")
    err = _demo_error(capsys, "--json", path, "--plot", path)
    assert "--json and --plot name the same file" in err
    assert not os.path.exists(path)  # the write check leaves nothing behind
