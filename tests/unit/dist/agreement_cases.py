"""The check builder and ``LogitsSpec`` on tp = 2 gloo ranks: a spec gives the config
and the errors of the stride-0 stand-in it replaces, and :class:`CrossRankCheck` raises on every
rank. Run by tests/unit/test_agreement_dist.py.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main, needs_tp2  # noqa: E402

from megatron_vocabstats.ops._checks import LogitsSpec, checked_config  # noqa: E402
from megatron_vocabstats.ops.agreement import (  # noqa: E402
    CrossRankCheck,
    Field,
    checked_on_every_rank,
)

CASES = Cases()
OPTIONS = dict(entropy="off")  # the other options: the defaults checked_config declares


def _message(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared below
        return type(exc), str(exc)
    return None


@CASES.register
def logits_spec_matches_the_stand_in(group):
    """Same config, and the same error on every rank, for a spec and a stride-0 stand-in."""
    rank, tp = needs_tp2(group)
    last = rank == tp - 1
    good = ((6, 16), torch.zeros(6, dtype=torch.long), {})
    cases = [
        good,
        ((2, 3, 16), torch.zeros(2, 3, dtype=torch.long), {"vocab_size": 30}),
        ((7 if last else 6, 16), torch.zeros(7 if last else 6, dtype=torch.long), {}),
        ((6, 16), torch.full((6,), 3 if last else 2, dtype=torch.long), {}),
        ((6, 16), torch.zeros(6, dtype=torch.long), {"temperature": 2.0 if last else 1.0}),
        ((6, 0 if last else 16), torch.zeros(6, dtype=torch.long), {}),
        ((6, 16), torch.zeros(6, dtype=torch.long),
         {"vocab_size": 32, "vocab_start": 0 if rank == 0 else 20}),
    ]
    for shape, target, extra in cases:
        opts = {**OPTIONS, **extra}
        stand_in = torch.empty(()).expand(shape)
        spec = LogitsSpec(shape, torch.float32, torch.device("cpu"))
        want = _message(lambda: checked_config(stand_in, target, group, **opts))
        got = _message(lambda: checked_config(spec, target, group, **opts))
        assert got == want, (shape, extra, got, want)
        if want is None:
            assert (checked_config(spec, target, group, **opts)
                    == checked_config(stand_in, target, group, **opts))
    for shape, target, extra in cases[2:]:
        assert _message(lambda: checked_config(
            LogitsSpec(shape, torch.float32, "cpu"), target, group, **{**OPTIONS, **extra}))


@CASES.register
def check_builder_raises_on_every_rank(group):
    rank, tp = needs_tp2(group)
    last = rank == tp - 1

    def build():
        return CrossRankCheck(group, validate=True, device=None, hint="the hint",
                              fields=("k", Field("ids", checksum=True)), extra=1)

    checks = build()
    assert checks.enabled and checks.size == tp
    assert checks.run(lambda: 4, row=lambda k: [k, 7, rank]) == 4
    table = checks.finish()
    assert [r[-1] for r in table] == list(range(tp)), table

    checks = build()
    checks.fail(KeyError("mine") if last else None)
    checks.run(lambda: 4, row=lambda k: [k, 7, rank])
    got = _message(checks.finish)
    assert got == ((KeyError, "'mine'") if last else
                   (ValueError, f"ranks [{tp - 1}] of tp_group rejected their inputs (see their "
                    "errors)")), got

    checks = build()
    checks.run(lambda: 4, row=lambda k: [k, 8 if last else 7, 0])
    got = _message(checks.finish)
    assert got == (ValueError, f"ids differs across the ranks of tp_group: ranks [{tp - 1}] "
                   "differ from rank 0; the hint"), got

    got = _message(lambda: checked_on_every_rank(
        lambda: 5 if last else 4, group, validate=True, device=None,
        agree=(("k", lambda k: k),), hint="the hint"))
    assert got == (ValueError, "k differs across the ranks of tp_group: "
                   f"{[4] * (tp - 1) + [5]} (in rank order); the hint"), got
    got = _message(lambda: checked_on_every_rank(
        (lambda: 1 / 0) if last else (lambda: 4), group, validate=True, device=None,
        hint="the hint"))
    assert got[0] is (ZeroDivisionError if last else ValueError), got


if __name__ == "__main__":
    main(CASES)
