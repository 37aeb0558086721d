"""``python -m megatron_vocabstats.megatron_lm``: the same as ``vocabstats-patch-megatron``.
May import: :mod:`.cli`."""

import sys

from .cli import main

sys.exit(main())
