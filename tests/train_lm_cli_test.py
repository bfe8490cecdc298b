"""examples/train_lm.py's command line: the contract's flags, clear errors (no training here)."""

import re

import example_scripts
import pytest


@pytest.fixture(scope="module")
def train_lm():
    with example_scripts.loaded("train_lm") as module:
        yield module


def parse(train_lm, *argv):
    parser = train_lm.build_parser()
    args = parser.parse_args([str(a) for a in argv])
    train_lm.check(parser, args)
    return args


def test_help_lists_the_contract_flags(train_lm, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(train_lm, "--help")
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--steps N", "--devices D", "--processes P", "--microbatches K", "--bitwise",
                 "--ckpt-dir DIR", "--save-every S", "--resume", "--params-out FILE.npz"):  # fmt: skip
        assert flag in text, flag
    assert "may change between a save and --resume" in text


def test_defaults(train_lm):
    args = parse(train_lm, "--steps", 20)
    assert (args.devices, args.processes, args.microbatches, args.bitwise) == (1, 1, 1, False)
    assert args.ckpt_dir is None and not args.resume and args.chunk_size is None


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--steps", 0], r"--steps must be >= 1; got 0"),
        (
            ["--steps", 4, "--devices", 3],
            r"--global-batch 16 must split into .* = 3 .*multiple of 3",
        ),
        (["--steps", 4, "--chunk-size", 2], r"--chunk-size only applies with --bitwise"),
        (["--steps", 4, "--resume"], r"--resume needs --ckpt-dir DIR"),
    ],
)
def test_errors_say_what_and_how_to_fix(train_lm, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        parse(train_lm, *argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_describe(train_lm):
    t = {"processes": 2, "devices": 2, "microbatches": 1}
    assert train_lm.describe(t) == "2 processes x 2 devices x 1 microbatch"
