"""The plugin's one import line and where it goes in a Megatron-LM training script (any release).

``import megatron_vocabstats.patch`` goes right after the script's first ``import torch`` line:
every Megatron-LM release's ``pretrain_gpt.py`` has one, and it precedes argument parsing and
model building. The shipped per-release patches (:mod:`.releases`) are this change made on each
release's script, so the patches and the inserter cannot disagree.
"""

from __future__ import annotations

LINE = ("import megatron_vocabstats.patch  # noqa: F401  "
        "(megatron-vocabstats: --vocab-parallel-stats)\n")
MARKER = "import megatron_vocabstats.patch"


def has_import(text: str) -> bool:
    """Whether the script ``text`` already imports the plugin's patch."""
    return MARKER in text


def add_import(text: str) -> str:
    """``text`` with :data:`LINE` (after a blank line) following its first ``import torch`` line;
    unchanged if it already imports the plugin.

    Raises ``ValueError`` when the script has no line that is exactly ``import torch``.
    """
    if has_import(text):
        return text
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == "import torch":
            return "".join(lines[: i + 1] + ["\n", LINE] + lines[i + 1 :])
    raise ValueError("no top-level 'import torch' line found: add the import by hand")
