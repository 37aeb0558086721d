"""Deprecated: ``python -m megatron_vocabstats.profile`` is
``python -m megatron_vocabstats.profiling`` (``summarize OUT``); ``run`` moved to
``python -m examples.gsm8k.profile run ...`` (from the repository root) and here only prints so,
with exit status 2.

May import: :mod:`megatron_vocabstats.profiling`.
"""

import sys

from ..profiling.cli import main

print("note: python -m megatron_vocabstats.profile is deprecated: use python -m "
      "megatron_vocabstats.profiling summarize, or python -m examples.gsm8k.profile run",
      file=sys.stderr, flush=True)
sys.exit(main(prog="python -m megatron_vocabstats.profile"))
