"""The plugin's import line and where it goes in a Megatron-LM training script: right after the
first ``import torch`` line, before argument parsing and model building in every release. The
shipped patches (:mod:`.releases`) are this change.
"""

from __future__ import annotations

LINE = ("import megatron_vocabstats.patch  # noqa: F401  "
        "(megatron-vocabstats: --vocab-parallel-stats)\n")
MARKER = "import megatron_vocabstats.patch"


def has_import(text: str) -> bool:
    """Whether the script ``text`` already imports the plugin's patch."""
    return MARKER in text


def add_import(text: str) -> str:
    """``text`` with a blank line and :data:`LINE` after its first ``import torch`` line (unchanged
    if it imports the plugin); ``ValueError`` when no line is exactly ``import torch``."""
    if has_import(text):
        return text
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == "import torch":
            return "".join(lines[: i + 1] + ["\n", LINE] + lines[i + 1 :])
    raise ValueError("no top-level 'import torch' line found: add the import by hand")
