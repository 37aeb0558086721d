"""Integrations with RL frameworks' own training code: their log-prob and entropy functions
rebound to the ops, one import each (as Liger-Kernel's ``apply_liger_kernel_to_*``).

- :mod:`.verl`: ``import megatron_vocabstats.integrations.verl`` (or its ``apply()``) makes verl's
  Megatron engine compute log-probs and entropy with the ops (docs/verl.md); :mod:`.verl_ops`
  holds the replacement functions, with verl's signatures and conventions.
- :mod:`.slime`: ``import megatron_vocabstats.integrations.slime`` (or slime's
  ``--custom-megatron-init-path megatron_vocabstats.integrations.slime.apply``) makes slime's
  ``calculate_log_probs_and_entropy`` run on the ops (docs/integrations.md); :mod:`.slime_ops`.
- :mod:`._framework`: what every integration shares (resolve and check every binding, replace
  all or none, restore).

:data:`PATCHERS` records, per framework, what its integration replaced; it lives here so that
reloading an integration module cannot forget what it replaced (as
``megatron._patching.PATCHER`` for ``megatron_vocabstats.patch``).
"""

from __future__ import annotations

from ..megatron._patching import Patcher

PATCHERS: dict[str, Patcher] = {}
