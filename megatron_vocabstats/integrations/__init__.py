"""Integrations with RL frameworks' own training code: one import per framework rebinds its
log-prob and entropy functions to the ops (as Liger-Kernel's ``apply_liger_kernel_to_*``).
Usage, conventions and differences: docs/integrations.md, docs/verl.md.
"""

from __future__ import annotations

from ..megatron._patching import Patcher

PATCHERS: dict[str, Patcher] = {}
