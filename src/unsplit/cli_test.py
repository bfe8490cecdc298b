"""The command line: help text, option checks, the jax environment it sets up, and
``unsplit audit MODULE:FACTORY`` (output, --strict, --json, factory errors)."""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import pytest

import unsplit
from unsplit import cli
from unsplit.audit_corpus import batched, per_example
from unsplit.demo import config as demo_config
from unsplit.demo import options as demo_options


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
    config = demo_options.config_from_args(args)
    assert config.steps == 5 and config.seed == 3
    assert config.width == demo_config.QUICK["width"]
    default = demo_options.config_from_args(cli.build_parser().parse_args(["demo"]))
    assert default == demo_config.DemoConfig()


def test_long_fills_what_is_not_given_and_excludes_quick(capsys):
    args = cli.build_parser().parse_args(["demo", "--long", "--width", "32"])
    config = demo_options.config_from_args(args)
    assert config.steps == demo_config.LONG["steps"] and config.width == 32
    assert not config.fast_compile  # the long run compiles with XLA's optimizations
    code, _, err = _run(capsys, ["demo", "--long", "--quick"])
    assert code == 2 and "not allowed with argument" in err


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


# ---- the demo's arguments: refused before any work, argparse style ----


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


# ---- unsplit audit ----

PROBLEM = "unsplit.audit_corpus.batched:same_key_microbatches"
CLEAN = "unsplit.audit_corpus.clean:vmapped_example_keys"


def _audit(capsys, argv):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_explains_the_audit_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "audit" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["audit", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for words in ("MODULE:FACTORY", "(fn, args)", "(loss_fn, args, options)", "--strict", "--json"):
        assert words in out
    assert "exit status" in out and "mean_of_means" in out


def test_default_output_is_one_panel_per_finding_with_the_source_line(capsys):
    code, out, _ = _audit(capsys, ["audit", PROBLEM])
    assert code == 0
    assert out.count("╭─ batch_draw") == 1
    assert "fix:" in out and "unsplit.value_and_grad" in out
    lines = pathlib.Path(batched.__file__).read_text().splitlines()
    line = next(i + 1 for i, t in enumerate(lines) if t.endswith("# expect: same_key_microbatches"))
    assert f"audit_corpus/batched.py:{line}" in out
    assert "jax.random.bernoulli(sub, 0.9" in out  # the source line itself
    assert "1 finding(s) in" in out


@pytest.mark.parametrize(("target", "code"), [(PROBLEM, 1), (CLEAN, 0)])
def test_strict_exits_1_on_any_finding(capsys, target, code):
    got, out, _ = _audit(capsys, ["audit", target, "--strict"])
    assert got == code
    assert ("no findings" in out) == (code == 0)


def test_json_lists_the_findings(capsys):
    code, out, _ = _audit(capsys, ["audit", "unsplit.audit_corpus.per_example:rbg_key", "--json"])
    assert code == 0
    (finding,) = json.loads(out)
    assert set(finding) == {"kind", "message", "fix", "file", "line"}
    assert finding["kind"] == "unsafe_key" and finding["file"] == per_example.__file__
    assert isinstance(finding["line"], int)
    _, clean, _ = _audit(capsys, ["audit", CLEAN, "--json"])
    assert json.loads(clean) == []


def test_a_file_path_factory(tmp_path, capsys):
    path = tmp_path / "mystep.py"
    path.write_text(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp

            def make():
                def step(w, x, key):
                    keep = jax.random.bernoulli(key, 0.9, x.shape)
                    return jnp.sum(jnp.where(keep, x, 0.0) @ w)
                return step, (jnp.ones(3), jnp.ones((8, 3)), jax.random.key(0))
            """
        )
    )
    code, out, _ = _audit(capsys, ["audit", f"{path}:make", "--json", "--strict"])
    assert code == 1
    (finding,) = json.loads(out)
    assert (finding["kind"], finding["file"], finding["line"]) == ("batch_draw", str(path), 6)


def test_batch_args_names_the_batch_when_the_guess_cannot(tmp_path, capsys):
    path = tmp_path / "batchfirst.py"
    path.write_text(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp

            def make():  # the batch first and as wide as the params: the guess takes params
                def step(x, w, key):
                    keep = jax.random.bernoulli(key, 0.9, x.shape)
                    return jnp.sum(jnp.where(keep, x, 0.0) @ w)
                return step, (jnp.ones((3, 3)), jnp.ones((3, 2)), jax.random.key(0))
            """
        )
    )
    with pytest.warns(UserWarning, match="twice as large"):  # the guess (w) cannot double
        code, out, _ = _audit(capsys, ["audit", f"{path}:make", "--json"])
    assert code == 0 and json.loads(out) == []
    code, out, _ = _audit(capsys, ["audit", f"{path}:make", "--json", "--batch-args", "0"])
    assert [(f["kind"], f["line"]) for f in json.loads(out)] == [("batch_draw", 6)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([PROBLEM, "--batch-args", "5"], "names arguments that"),
        (["unsplit.audit_corpus.per_example:rbg_key", "--batch-args", "1"], "drop --batch-args"),
    ],
)
def test_batch_args_errors_exit_2_with_the_fix(capsys, argv, message):
    code, out, err = _audit(capsys, ["audit", *argv])
    assert code == 2 and out == "" and message in err and "Fix:" in err


def test_batch_args_must_be_positions(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["audit", PROBLEM, "--batch-args", "x,y"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "expected argument positions" in err and "Fix:" in err


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_colon_here", "expected MODULE:FACTORY"),
        ("no.such.module:make", "could not import module 'no.such.module'"),
        ("unsplit.audit_corpus.batched:nope", "has no attribute 'nope'"),
        ("unsplit.audit_corpus.batched:MICROBATCHES", "is a int, not a function"),
        ("unsplit.audit_corpus._data:key", "must return (fn, args) or (loss_fn, args, options)"),
        ("/no/such/file.py:make", "no such file"),
    ],
)
def test_factory_errors_exit_2_with_the_fix(capsys, target, message):
    code, out, err = _audit(capsys, ["audit", target])
    assert code == 2 and out == ""
    assert message in err and err.startswith("unsplit audit: ") and "Fix:" in err


def test_factory_results_are_checked(capsys, monkeypatch):
    def raises():
        raise RuntimeError("no data today")

    def args_not_a_tuple():
        step, args = batched.batch_level_dropout()
        return step, {"w": args[0]}

    def options_not_a_dict():
        loss_fn, args, _ = per_example.closure_key()
        return loss_fn, args, ["weighted"]

    def wrong_option():
        loss_fn, args, _ = per_example.closure_key()
        return loss_fn, args, {"weigted": True}

    def does_not_trace():
        step, args = batched.batch_level_dropout()
        return step, args[:2]  # the key is missing

    def not_callable():
        return 42, ()

    cases = {
        "raises": "raised RuntimeError: no data today",
        "does_not_trace": "does_not_trace() returned failed: TypeError",
        "not_callable": "returned fn=42, which is not callable",
        "args_not_a_tuple": "expected a tuple of fn's positional inputs",
        "options_not_a_dict": "expected a dict of unsplit.audit options",
        "wrong_option": "accepts weighted and has_aux",
    }
    for name, message in cases.items():
        monkeypatch.setattr(batched, name, locals()[name], raising=False)
        code, _, err = _audit(capsys, ["audit", f"unsplit.audit_corpus.batched:{name}"])
        assert code == 2 and message in err and "Fix:" in err, (name, err)


def test_a_module_that_fails_to_import(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text("raise ImportError('missing dependency')\n")
    code, _, err = _audit(capsys, ["audit", f"{path}:make"])
    assert code == 2 and "raised ImportError: missing dependency" in err and "Fix:" in err


def test_an_unsplit_step_is_audited_as_it_calls_its_loss(capsys, monkeypatch):
    def bitwise_step():  # a bitwise step cannot be traced; its per-example loss can
        loss_fn, args, _ = per_example.closure_key()
        return unsplit.value_and_grad(loss_fn, bitwise=True, chunk_size=4), args

    monkeypatch.setattr(batched, "bitwise_step", bitwise_step, raising=False)
    code, out, _ = _audit(capsys, ["audit", "unsplit.audit_corpus.batched:bitwise_step", "--json"])
    assert code == 0
    assert [(f["kind"], f["file"]) for f in json.loads(out)] == [
        ("foreign_key", per_example.__file__)
    ]


def test_the_output_shown_in_the_docs_is_real(capsys, monkeypatch):
    root = pathlib.Path(__file__).resolve().parents[2]
    text = (root / "docs" / "audit.md").read_text()
    block = text.split("### Real output", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.chdir(root)
    runs = block.split("$ unsplit ")[1:]
    assert len(runs) >= 4
    for run in runs:
        command, _, shown = run.partition("\n")
        argv = command.split(";")[0].split()
        with jax.numpy_dtype_promotion("standard"):  # the corpus is user code (optax)
            code, out, err = _audit(capsys, argv)
        assert not err, err
        expected = [line for line in shown.splitlines() if not line.startswith("exit status")]
        got = out.replace(str(root), "...").splitlines()
        assert [line.rstrip() for line in got] == [line.rstrip() for line in expected if line], argv
        if "exit status" in shown:
            assert f"exit status {code}" in shown, argv


def test_python_m_unsplit_audit_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "unsplit", "audit", PROBLEM, "--strict", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert [f["kind"] for f in json.loads(proc.stdout)] == ["batch_draw"]


def test_only_the_demo_command_imports_the_demo():
    # `unsplit --help` and `unsplit audit` run on a core install: they never import the demo.
    code = (
        "import sys\n"
        "from unsplit import cli\n"
        "cli.build_parser(None).format_help()\n"
        "cli.build_parser('audit').parse_args(['audit', 'm:f'])\n"
        "assert not [m for m in sys.modules if m.startswith('unsplit.demo')], sys.modules\n"
        "cli.build_parser('demo')\n"
        "assert 'unsplit.demo.config' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"unsplit {unsplit.__version__}"


_REPLAY_FACTORY = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import unsplit

SHIFT = {shift}

def loss_fn(p, x, key):
    h = jax.nn.gelu(x @ p["w1"])
    h = jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h / 0.9, 0.0)
    return jnp.sum((h @ p["w2"] - x) ** 2)

def make(mesh):
    rng = np.random.default_rng(0)
    params = {{"w1": rng.normal(size=(8, 32)).astype(np.float32) + SHIFT,
              "w2": rng.normal(size=(32, 8)).astype(np.float32) / 4}}
    if mesh is not None:
        specs = {{"w1": P(None, "model"), "w2": P("model", None)}}
        params = {{k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}}
    x = rng.normal(size=(16, 8)).astype(np.float32)
    step = unsplit.value_and_grad(loss_fn, mesh=mesh, bitwise=unsplit.Bitwise(chunk_size=4))
    return dict(step=step, params=params, batch=x, key=jax.random.key(1), step_number=5)
"""


def test_replay_records_on_one_layout_and_compares_on_another(tmp_path, capsys):
    factory = tmp_path / "train_a.py"
    factory.write_text(_REPLAY_FACTORY.format(shift=0.0))
    record = tmp_path / "step5.json"
    assert cli.main(["replay", f"{factory}:make", "--mesh", "data=4,model=2",
                     "--save", str(record)]) == 0  # fmt: skip
    assert "recorded" in capsys.readouterr().out
    assert cli.main(["replay", f"{factory}:make", "--mesh", "data=1,model=8",
                     "--against", str(record)]) == 0  # fmt: skip
    assert "every leaf is bit-identical" in capsys.readouterr().out
    other = tmp_path / "train_b.py"
    other.write_text(_REPLAY_FACTORY.format(shift=1.0))
    assert cli.main(["replay", f"{other}:make", "--mesh", "data=2,model=4",
                     "--against", str(record)]) == 1  # fmt: skip
    out = capsys.readouterr().out
    assert "DIFF  ['inputs']['params']['w1']" in out and "not the recorded step" in out


@pytest.mark.parametrize(
    ("mesh", "message"),
    [("data:4", "AXIS=SIZE pairs"), ("data=64", "needs 64 devices; this process has 8")],
)
def test_replay_refuses_a_bad_mesh_with_the_fix(tmp_path, capsys, mesh, message):
    factory = tmp_path / "train_c.py"
    factory.write_text(_REPLAY_FACTORY.format(shift=0.0))
    assert cli.main(["replay", f"{factory}:make", "--mesh", mesh, "--save", "x.json"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Fix:" in err
