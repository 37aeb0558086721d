"""Public test and tool utilities; none of it is on the plugin's training path.

- :mod:`.host_sync`: :func:`forbid_host_sync` / :class:`HostSyncError`, proving that a code path
  never synchronises with the host (re-exported here:
  ``megatron_vocabstats.testing.forbid_host_sync``).
- :mod:`.megatron_cpu`: CPU shims that let Megatron-Core's ``GPTModel`` run without CUDA
  (:func:`~.megatron_cpu.install_cpu_shims`, :func:`~.megatron_cpu.cuda_factories_on_cpu`), for
  the tests and the CPU runs of the examples. Not imported here (import the submodule).

The plugin never imports this package.
"""

from .host_sync import HostSyncError, forbid_host_sync

__all__ = ["HostSyncError", "forbid_host_sync"]
