"""Errors that named nothing or the wrong thing (the number options are in
``test_number_checks.py``, the flags in ``test_megatron_patch.py``, the example's outputs in
``test_example_gsm8k_cli.py``)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import megatron_vocabstats as mv
from megatron_vocabstats.profiling import cli

TRIAL = {"trial": "memory-step2-rank0", "kind": "memory", "rank": 0, "step": 2}
RAW = {"backend": "cpu", "kinds": ["a"],
       "timeline": {"x": [0, 1, 2], "x_label": "t", "total": [1, 3, 2], "phase": ["f", "f", "b"],
                    "samples": 3, "by_kind": {"a": [1, 3, 2]}}}


def _trial(tmp_path, meta, raw):
    trial = tmp_path / "memory-step2-rank0"
    trial.mkdir()
    (trial / "trial.json").write_text(json.dumps(meta))
    (trial / "memory.raw.json").write_text(json.dumps(raw))
    return trial


@pytest.mark.parametrize("change, culprit", [
    (dict(kind=["memory"]), "trial.json: not a trial record"),
    (dict(trial={"name": 1}), "trial.json: not a trial record"),
    (dict(rank="0"), "trial.json: not a trial record"),
    ("timeline", "memory.raw.json does not have the layout of a memory trial"),
])
def test_summarize_names_the_malformed_file(tmp_path, capsys, change, culprit):
    """A malformed trial.json died with a TypeError traceback; timelines of unequal lengths
    failed in matplotlib with a message that named no file."""
    pytest.importorskip("matplotlib")
    meta, raw = dict(TRIAL), json.loads(json.dumps(RAW))
    if change == "timeline":
        raw["timeline"]["x"] = [0, 1]
    else:
        meta.update(change)
    trial = _trial(tmp_path, meta, raw)
    assert cli.main(["summarize", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and culprit in err and str(trial) in err, err
    assert "Traceback" not in err


def test_summarize_accepts_the_well_formed_trial(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    trial = _trial(tmp_path, TRIAL, RAW)
    assert cli.main(["summarize", str(tmp_path)]) == 0
    assert os.path.isfile(trial / "summary.md")


def test_transposed_fused_weight_gets_a_hint():
    hidden, weight = torch.randn(3, 4), torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"weight must be \[V/tp, H\] .* it looks transposed"):
        mv.linear_vocab_parallel_stats(hidden, weight.t(), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"weight must be \[V/tp, H\] with the hidden size H = 4"
                       ) as info:
        mv.linear_vocab_parallel_stats(hidden, torch.randn(8, 5), None)
    assert "transposed" not in str(info.value)


@pytest.mark.parametrize("option, value, error", [
    ("entropy", True, TypeError), ("entropy", "full", ValueError),
    ("kernel", None, TypeError), ("kernel", "cuda", ValueError),
])
def test_a_choice_of_the_wrong_type_is_a_type_error(option, value, error):
    """``entropy=True`` raised a plain ValueError while other wrong types raise InputTypeError
    (a TypeError, and a ValueError too); a wrong value of the right type stays a ValueError."""
    with pytest.raises(ValueError, match=f"^{option} must be one of") as info:
        mv.vocab_parallel_stats(torch.randn(3, 8), torch.tensor([1, 2, 3]), **{option: value})
    assert isinstance(info.value, TypeError) == (error is TypeError)


def test_an_out_of_range_id_names_what_holds_the_vocabulary():
    """The fused head's message spoke of "these logits", which its caller never held."""
    hidden, weight, target = torch.randn(3, 8), torch.randn(20, 8), torch.tensor([1, 2, 25])
    with pytest.raises(ValueError, match="so the output layer's weight rows must hold the whole"):
        mv.linear_vocab_parallel_stats(hidden, weight, target)
    with pytest.raises(ValueError, match="so these logits must hold the whole vocabulary"):
        mv.vocab_parallel_stats(hidden @ weight.T, target)


def test_target_of_any_integer_dtype():
    """The message said int64 while int32 ids are accepted (with the same result)."""
    logits, target = torch.randn(3, 8), torch.tensor([1, 2, 7])
    want = mv.vocab_parallel_stats(logits, target)
    got = mv.vocab_parallel_stats(logits, target.int())
    assert all(torch.equal(a, b) for a, b in zip(want[:3], got[:3]))
    with pytest.raises(ValueError, match=r"integer token ids \(an integer dtype: int64, int32"):
        mv.vocab_parallel_stats(logits, target.float())


@pytest.mark.parametrize("value", [0, -1.0, 1e-40])
def test_temperature_floor_reads_as_positive(value):
    """``temperature=0`` said "must be a finite number >= 2.93874e-39", a floor that reads as
    noise; the rule is "> 0", with that floor (1 / the largest fp32) in parentheses."""
    with pytest.raises(ValueError, match=r"^temperature must be a finite number > 0 \(at least "
                                         r"2\.93874e-39\), got "):
        mv.vocab_parallel_stats(torch.randn(3, 8), torch.tensor([1, 2, 3]), temperature=value)
