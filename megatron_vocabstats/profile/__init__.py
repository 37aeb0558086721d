"""Rank-aware memory and kernel profiling of steps of the example job (``examples/gsm8k``).

``python -m megatron_vocabstats.profile run --out OUT [--ranks 0,2-4] [--profile-steps 2]
[--trials memory,kernels] [--overwrite] -- sft <example flags>`` (under ``torchrun`` for
several ranks), and ``python -m megatron_vocabstats.profile summarize OUT``. See :mod:`.runner`
for the run, :mod:`.memory` and :mod:`.kernels` for the instruments, :mod:`.summary` for the
outputs.
Importing this package imports neither Megatron nor the example.
"""

from .kernels import split_trace, trace_stats
from .memory import classify_frames, replay_trace
from .postprocess import summarize
from .ranks import default_ranks, parse_ranks, parse_steps, parse_trials

__all__ = ["classify_frames", "default_ranks", "parse_ranks", "parse_steps", "parse_trials",
           "replay_trace", "split_trace", "summarize", "trace_stats"]
