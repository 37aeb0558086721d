"""``python -m megatron_vocabstats.megatron_lm``: the same as ``vocabstats-patch-megatron``."""

import sys

from .cli import main

sys.exit(main())
