"""``python -m examples.gsm8k`` / ``torchrun ... -m examples.gsm8k``: see :mod:`.cli`."""

import sys

from .cli import main

sys.exit(main())
