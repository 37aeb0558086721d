"""The checks and math modules: the split of ``ops/_checks.py`` and ``ops/_math.py``, the
public ``ops.agreement`` and ``ops.options`` modules, the check builder and ``LogitsSpec``."""

from __future__ import annotations

import pytest
import torch

from megatron_vocabstats.ops import options
from megatron_vocabstats.ops._argtypes import InputTypeError
from megatron_vocabstats.ops._checks import LogitsSpec, checked_config
from megatron_vocabstats.ops.agreement import CrossRankCheck, checked_on_every_rank

OPTIONS = dict(entropy="off")  # the other options: the defaults checked_config declares


def test_public_modules_hold_the_shared_options():
    assert options.IGNORE_INDEX == -100
    assert options.BATCH_INVARIANT_NAMES == {"off": False, "batch": True, "tp": "tp"}
    from megatron_vocabstats import losses, packing
    from megatron_vocabstats.megatron import arguments

    assert losses.IGNORE_INDEX == packing.IGNORE_INDEX == options.IGNORE_INDEX
    assert arguments.BATCH_INVARIANT_FLAG == options.BATCH_INVARIANT_NAMES


def _stand_in(shape, dtype=torch.float32):
    return torch.empty((), dtype=dtype).expand(shape)


@pytest.mark.parametrize("shape", [(6, 32), (2, 3, 32), (0, 32), (32,)])
@pytest.mark.parametrize("extra", [{}, {"vocab_size": 30}, {"vocab_size": 30, "vocab_start": 0},
                                   {"batch_invariant": "tp", "chunk_size": 4}])
def test_logits_spec_gives_the_config_of_the_stand_in(shape, extra):
    target = torch.zeros(shape[:-1], dtype=torch.long)
    opts = {**OPTIONS, **extra}
    want = checked_config(_stand_in(shape), target, None, **opts)
    for spec in (LogitsSpec(shape, torch.float32, torch.device("cpu")),
                 LogitsSpec(list(shape), torch.float32, "cpu")):
        assert checked_config(spec, target, None, **opts) == want


@pytest.mark.parametrize(("logits", "target", "opts", "match"), [
    ((4, 8), (5,), {}, "must equal the leading shape"),
    ((4, 0), (4,), {}, "is empty"),
    ((), None, {}, "at least one dimension"),
    ((4, 8), (4,), {"entropy": "x"}, "entropy must be one of"),
    ((4, 8), (4,), {"vocab_size": 9}, "does not fit"),
])
def test_logits_spec_raises_the_errors_of_the_stand_in(logits, target, opts, match):
    target = None if target is None else torch.zeros(target, dtype=torch.long)
    opts = {**OPTIONS, **opts}
    with pytest.raises(ValueError, match=match) as want:
        checked_config(_stand_in(logits), target, None, **opts)
    with pytest.raises(ValueError, match=match) as got:
        checked_config(LogitsSpec(logits, torch.float32, torch.device("cpu")), target, None,
                       **opts)
    # The same message, but for what holds the vocabulary: a spec stands for the fused head's
    # logits, which its caller never held.
    assert str(got.value) == str(want.value).replace("these logits",
                                                     "the output layer's weight rows")
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        checked_config(LogitsSpec((4, 8), torch.int32, torch.device("cpu")), None, None,
                       **OPTIONS)


def test_local_error_with_a_spec_raises_it():
    problem = InputTypeError("hidden must be a tensor")
    with pytest.raises(InputTypeError, match="hidden must be a tensor"):
        checked_config(LogitsSpec((0,), torch.float32, "cpu"), None, None,
                       local_error=problem, **OPTIONS)


def test_check_builder_without_exchange_raises_on_this_rank():
    checks = CrossRankCheck(None, validate=True, device=None, hint="h", fields=("k",))
    assert not checks.enabled and checks.size == 1
    with pytest.raises(KeyError):
        checks.run(lambda: {}["x"], row=lambda r: 1 / 0)
    assert checks.run(lambda: 3, row=lambda r: 1 / 0) == 3  # no row without an exchange
    assert checks.finish() is None
    checks.fail(ValueError("first"))
    checks.fail(ValueError("second"))
    assert checks.run(lambda: 1 / 0) is None  # skipped once a problem is recorded
    with pytest.raises(ValueError, match="first"):
        checks.finish()
    with pytest.raises(InputTypeError, match="tp_group must be"):
        CrossRankCheck("group", validate=True, device=None, hint="h")


def test_checked_on_every_rank_alone_runs_the_check_only():
    assert checked_on_every_rank(lambda: 5, None, validate=True, device=None,
                                 agree=(("k", lambda r: 1 / 0),), hint="h") == 5
    with pytest.raises(ZeroDivisionError):
        checked_on_every_rank(lambda: 1 / 0, None, validate=True, device=None, hint="h")
