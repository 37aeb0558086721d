"""``python -m megatron_vocabstats.profiling summarize OUT``: see :mod:`.cli`."""

import sys

from .cli import main

sys.exit(main())
