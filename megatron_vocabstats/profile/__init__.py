"""Deprecated alias of :mod:`megatron_vocabstats.profiling` (``profile`` and ``profiling``
collided).

Importing it warns (``DeprecationWarning``) and re-exports the trace analysis of
:mod:`megatron_vocabstats.profiling`; ``megatron_vocabstats.profile.memory`` (``.kernels``,
``.postprocess``, ``.ranks``, ``.summary``) are the same module objects as
``megatron_vocabstats.profiling.memory`` etc. Importing ``megatron_vocabstats.profile.runner``
raises an ``ImportError`` that says where it went: the example-profiling run moved to
``examples/gsm8k/profile.py`` (``python -m examples.gsm8k.profile run ...`` from the repository
root), so that the plugin never imports the example.

May import: :mod:`megatron_vocabstats.profiling` only.
"""

import sys
import warnings

from ..profiling import (
    classify_frames,
    default_ranks,
    kernels,
    memory,
    parse_ranks,
    parse_steps,
    parse_trials,
    postprocess,
    ranks,
    replay_trace,
    split_trace,
    summarize,
    summary,
    trace_stats,
)

warnings.warn("megatron_vocabstats.profile is deprecated: import megatron_vocabstats.profiling; "
              "the run command is python -m examples.gsm8k.profile run",
              DeprecationWarning, stacklevel=2)

for _module in (kernels, memory, postprocess, ranks, summary):
    sys.modules.setdefault(f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}", _module)
del _module

__all__ = ["classify_frames", "default_ranks", "parse_ranks", "parse_steps", "parse_trials",
           "replay_trace", "split_trace", "summarize", "trace_stats"]
