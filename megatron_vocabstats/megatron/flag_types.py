"""The value types of the ``--vocab-parallel-stats`` flags: argparse ``type`` objects that also
check values set without the parser (``ops._argtypes.number_problem``).
"""

from __future__ import annotations

import argparse
import math

from ..ops._argtypes import describe_range, number_problem


class IntAtLeast:
    """An argparse ``type``: an integer >= ``minimum``, else ``argparse.ArgumentTypeError``;
    :meth:`problem` returns the complaint about a value set without the parser, or None."""

    def __init__(self, minimum: int, maximum: int | None = 2**63 - 1):
        self.minimum, self.maximum = minimum, maximum
        self.__name__ = f"integer >= {minimum}"  # argparse's name for the type in messages

    def describe(self) -> str:
        return describe_range(integer=True, low=self.minimum, high=self.maximum)

    def problem(self, value) -> str | None:
        problem = number_problem(value, integer=True, low=self.minimum, high=self.maximum)
        return problem and problem[1]

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(
                f"must be {self.describe()}, got {text!r}") from None
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value


class FloatIn:
    """An argparse ``type``: a finite float from ``low`` to ``high`` (closed unless ``open_low``
    / ``open_high``; an infinite bound is none). Errors as :class:`IntAtLeast`."""

    def __init__(self, low: float = -math.inf, high: float = math.inf, *,
                 open_low: bool = False, open_high: bool = False):
        self.low, self.high, self.open_low, self.open_high = low, high, open_low, open_high
        self.__name__ = self.describe()

    def _range(self) -> dict:
        return dict(low=self.low if math.isfinite(self.low) else None,
                    high=self.high if math.isfinite(self.high) else None,
                    low_open=self.open_low, high_open=self.open_high)

    def describe(self) -> str:
        return describe_range(**self._range())

    def problem(self, value) -> str | None:
        problem = number_problem(value, **self._range())
        return problem and problem[1]

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}") from None
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value


class TopK(IntAtLeast):
    """An argparse ``type`` for a top-k: an integer >= 1, or -1 (vLLM's "off") parsed as None;
    :meth:`problem` accepts None and -1. Errors as :class:`IntAtLeast`."""

    def __init__(self):
        super().__init__(1, maximum=None)  # a k of V or more keeps everything
        self.__name__ = "integer >= 1 or -1 (off)"

    def problem(self, value) -> str | None:
        if value is None or (value == -1 and not isinstance(value, bool)):
            return None
        problem = super().problem(value)
        return problem and f"{problem} (or -1 = off)"

    def __call__(self, text: str) -> int | None:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(
                f"must be an int >= 1 or -1 (off), got {text!r}") from None
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return None if value == -1 else value


# The value flags of the family and their types: the parser and config_hook check the same.
FLAG_TYPES = {
    "logprobs_chunk_size": IntAtLeast(0),
    "lm_head_chunk_size": IntAtLeast(0),
    "entropy_coef": FloatIn(),
    "vocab_stats_label_smoothing": FloatIn(0.0, 1.0, open_high=True),
    "rollout_temperature": FloatIn(0.0, open_low=True),
    "rollout_top_k": TopK(),
    "rollout_top_p": FloatIn(0.0, 1.0, open_low=True),
    "rollout_min_p": FloatIn(0.0, 1.0, open_high=True),
    "rollout_correction_threshold": FloatIn(0.0, open_low=True),
    "rollout_correction_low": FloatIn(0.0, 1.0, open_low=True),
    "rollout_correction_high": FloatIn(1.0),
}
# Value flags whose default None means "unset" (the mode's default); None passes their check.
OPTIONAL_FLAGS = ("rollout_correction_threshold", "rollout_correction_low",
                  "rollout_correction_high")
# The rollout flags: options of functions the user's forward step calls (policy_loss, the
# sampling log-probs), not of the patched loss, so they apply with or without the switch.
ROLLOUT_FLAGS = {"rollout_temperature": "rollout_temperature", "rollout_top_k": "rollout_top_k",
                 "rollout_top_p": "rollout_top_p", "rollout_min_p": "rollout_min_p",
                 "rollout_correction": "rollout_correction_mode",
                 "rollout_correction_level": "rollout_correction_level",
                 "rollout_correction_threshold": "rollout_correction_threshold",
                 "rollout_correction_low": "rollout_correction_low",
                 "rollout_correction_high": "rollout_correction_high"}
