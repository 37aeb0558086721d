"""Public test and tool utilities, never imported by the plugin: :func:`forbid_host_sync` and the
CPU shims of :mod:`.megatron_cpu` (import that submodule).
"""

from .host_sync import HostSyncError, forbid_host_sync

__all__ = ["HostSyncError", "forbid_host_sync"]
