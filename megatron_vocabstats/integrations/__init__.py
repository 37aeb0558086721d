"""Integrations with RL frameworks' own training code: their log-prob and entropy functions
rebound to the ops, one import each (as Liger-Kernel's ``apply_liger_kernel_to_*``).

- :mod:`.verl`: ``import megatron_vocabstats.integrations.verl`` (or its ``apply()``) makes verl's
  Megatron engine compute log-probs and entropy with the ops (docs/verl.md).
- :mod:`.verl_ops`: the replacement functions, with verl's signatures and conventions.

:data:`VERL_PATCHER` records what the verl integration replaced; it lives here, not in
:mod:`.verl`, so that reloading that module cannot forget what it replaced (as
``megatron._patching.PATCHER`` for ``megatron_vocabstats.patch``).

May import: :mod:`megatron_vocabstats.megatron._patching` (the reversible replacement, standard
library only). Nothing else in the package imports this subpackage.
"""

from __future__ import annotations

from ..megatron._patching import Patcher

VERL_PATCHER = Patcher()
