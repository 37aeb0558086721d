"""The benchmarks write a new directory per run and the committed tables only when asked
(benchmarks/_runner.py: ``--out``, ``--results``, ``--append``)."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))

import _runner  # noqa: E402


def _parse(argv, *, append=False):
    parser = argparse.ArgumentParser(prog="bench")
    _runner.add_output_arguments(parser, "topk")
    if append:
        parser.add_argument("--append", action="store_true")
    return parser, parser.parse_args(argv)


def test_default_is_a_new_directory_never_the_committed_tables():
    parser, args = _parse([])
    prefix = _runner.output_prefix(parser, args, "topk")
    assert os.path.dirname(os.path.dirname(prefix)) == _runner.OUTPUTS_DIR
    assert os.path.basename(os.path.dirname(prefix)).startswith("topk-")
    assert not prefix.startswith(_runner.RESULTS_DIR)
    parser, args = _parse(["--results"])
    assert _runner.output_prefix(parser, args, "topk") == os.path.join(_runner.RESULTS_DIR, "topk")


def test_existing_tables_are_refused_unless_appended(tmp_path, capsys):
    prefix = str(tmp_path / "run")
    (tmp_path / "run.md").write_text("earlier results\n")
    parser, args = _parse(["--out", prefix], append=True)
    with pytest.raises(SystemExit):
        _runner.output_prefix(parser, args, "topk")
    assert "run.md exists; give a new prefix, or --append" in capsys.readouterr().err
    parser, args = _parse(["--out", prefix, "--append"], append=True)
    assert _runner.output_prefix(parser, args, "topk") == prefix
    parser, args = _parse(["--out", prefix, "--results"])
    with pytest.raises(SystemExit):
        _runner.output_prefix(parser, args, "topk")
    assert "--out and --results" in capsys.readouterr().err


BENCH_DIR = os.path.dirname(_runner.__file__)
DRIVERS = sorted(f[:-3] for f in os.listdir(BENCH_DIR) if f.startswith("bench_")
                 and f.endswith(".py") and "drive(" in open(os.path.join(BENCH_DIR, f)).read())


@pytest.mark.parametrize("name", DRIVERS)
def test_every_driver_writes_the_committed_tables_only_with_results(name, monkeypatch):
    """Each script's own main(): by default a new directory, the committed table only with
    --results (bench_mtp_head.py wrote benchmarks/results/mtp_head.md on every run)."""
    import importlib

    module = importlib.import_module(name)
    outs = []
    monkeypatch.setattr(module, "drive", lambda *a, out, **k: outs.append(out))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(sys, "argv", [name + ".py"])
    module.main()
    assert os.path.dirname(os.path.dirname(outs[-1])) == _runner.OUTPUTS_DIR, outs[-1]
    monkeypatch.setattr(sys, "argv", [name + ".py", "--results"])
    module.main()
    assert os.path.dirname(outs[-1]) == _runner.RESULTS_DIR, outs[-1]
