"""The command line: help text, option checks and the jax environment it sets up."""

import argparse
import subprocess
import sys

import pytest

from unsplit import cli
from unsplit.demo import config as demo_config


def _run(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_top_help_names_the_demo(capsys):
    code, out, _ = _run(capsys, ["--help"])
    assert code == 0
    assert "demo" in out and "value_and_grad" in out


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 0
    assert "demo" in capsys.readouterr().out


def test_demo_help_explains_every_option(capsys):
    code, out, _ = _run(capsys, ["demo", "--help"])
    assert code == 0
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    demo = commands.choices["demo"]
    for action in demo._actions:
        assert action.help, f"option {action.option_strings} has no help text"
        for opt in action.option_strings:
            assert opt in out
    for words in ("8 devices", "bitwise", "shard_prng_key", "T5X", "MultiSteps", "--quick"):
        assert words in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "12"], "multiple of 8"),
        (["--steps", "1"], "steps must be >= 2"),
        (["--dropout", "0"], "dropout must be in (0, 1)"),
        (["--width", "30", "--heads", "4"], "multiple of heads"),
        (["--layers", "0"], "layers must be >= 1"),
        (["--learning-rate", "-1"], "learning_rate must be > 0"),
        (["--steps", "many"], "invalid int value"),
        (["--plot", "/no/such/folder/demo.png"], "does not exist"),
        (["--json", "/no/such/folder/out.json"], "does not exist"),
        (["--frobnicate"], "unrecognized arguments"),
    ],
)
def test_bad_options_fail_fast_with_the_fix(capsys, argv, message):
    code, _, err = _run(capsys, ["demo", *argv])
    assert code == 2
    assert message in err


def test_plot_path_that_is_a_folder_is_refused(capsys, tmp_path):
    code, _, err = _run(capsys, ["demo", "--plot", str(tmp_path)])
    assert code == 2 and "is a folder" in err


def test_quick_fills_only_what_is_not_given():
    args = cli.build_parser().parse_args(["demo", "--quick", "--steps", "5", "--seed", "3"])
    config = cli.config_from_args(args)
    assert config.steps == 5 and config.seed == 3
    assert config.width == demo_config.QUICK["width"]
    default = cli.config_from_args(cli.build_parser().parse_args(["demo"]))
    assert default == demo_config.DemoConfig()


def test_xla_flags_keep_what_the_user_set():
    assert cli.xla_flags("") == "--xla_force_host_platform_device_count=8"
    flags = cli.xla_flags("--xla_dump_to=/tmp/x", fast_compile=True).split()
    assert flags == [
        "--xla_dump_to=/tmp/x",
        "--xla_force_host_platform_device_count=8",
        "--xla_backend_optimization_level=0",
    ]
    mine = "--xla_force_host_platform_device_count=16 --xla_backend_optimization_level=2"
    assert cli.xla_flags(mine, fast_compile=True) == mine


def test_python_dash_m_unsplit_help():
    out = subprocess.run(
        [sys.executable, "-m", "unsplit", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "usage: unsplit demo" in out
