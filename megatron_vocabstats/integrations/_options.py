"""The options an integration's ``apply(**options)`` takes, and its notes: how a replacement
differs from the framework's function, logged once per name (rank 0, WARNING) at its first call.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..megatron.settings import PluginSettings
from ..version_check import is_rank0

logger = logging.getLogger("megatron_vocabstats")

# The options apply() takes by default: fields of PluginSettings, with the same meaning and checks,
# except that lm_head_chunk_size 0 means auto here (the framework, not the plugin, decides to fuse).
NAMES = ("vocab_size", "logprobs_chunk_size", "lm_head_chunk_size", "validate",
         "batch_invariant", "kernel")


class IntegrationOptions:
    """One framework's options in force and the notes already logged. ``notes``: ``{replaced
    name: what differs}``; ``padding``: appended to a note when ``vocab_size`` is set (the
    framework's own treatment of the padding columns); ``names``: the options ``apply()`` takes."""

    def __init__(self, framework: str, notes: Mapping[str, str], padding: str = "",
                 names: tuple[str, ...] = NAMES):
        self.framework, self.notes, self.padding, self.names = framework, notes, padding, names
        self.settings = PluginSettings(active=False)
        self.noted: set[str] = set()

    def configured(self, **options) -> PluginSettings:
        """``options`` (only :attr:`names`) checked as ``PluginSettings`` fields."""
        unknown = sorted(set(options) - set(self.names))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} of the {self.framework} integration; "
                             f"it takes {list(self.names)}")
        return PluginSettings(active=True, **options)

    def configure(self, settings: PluginSettings) -> None:
        """Make ``settings`` the options of every replacement."""
        self.settings = settings

    def reset(self) -> None:
        """Back to the defaults; every note will be logged again at its next first call."""
        self.settings = PluginSettings(active=False)
        self.noted.clear()

    def note_once(self, name: str) -> None:
        """Log ``notes[name]`` the first time (rank 0 only)."""
        if name in self.noted:
            return
        self.noted.add(name)
        if is_rank0():
            padding = ("" if self.settings.vocab_size is None else
                       f"; vocab_size={self.settings.vocab_size}: the padding columns get zero "
                       f"probability ({self.padding or 'theirs count'})")
            logger.warning("megatron-vocabstats (%s): %s %s%s.", self.framework, name,
                           self.notes[name], padding)
