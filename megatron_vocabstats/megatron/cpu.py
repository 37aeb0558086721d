"""Deprecated: the CPU shims moved to :mod:`megatron_vocabstats.testing.megatron_cpu` (test and
tool code, not the plugin's training path). This module re-exports them and warns on import.

May import: :mod:`megatron_vocabstats.testing.megatron_cpu` only.
"""

import warnings

from ..testing.megatron_cpu import cuda_factories_on_cpu, install_cpu_shims

warnings.warn("megatron_vocabstats.megatron.cpu is deprecated: import "
              "megatron_vocabstats.testing.megatron_cpu", DeprecationWarning, stacklevel=2)

__all__ = ["cuda_factories_on_cpu", "install_cpu_shims"]
