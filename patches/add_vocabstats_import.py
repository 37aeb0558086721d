"""Add megatron-vocabstats' one import line to a Megatron-LM training script (any release).

    python patches/add_vocabstats_import.py /path/to/Megatron-LM/pretrain_gpt.py

Inserts ``import megatron_vocabstats.patch`` right after the script's first ``import torch`` line
(every Megatron-LM release's pretrain_gpt.py has one, and it precedes argument parsing and model
building). Idempotent: a script that already has the line is left unchanged. Prints what it did.
"""

from __future__ import annotations

import sys

LINE = "import megatron_vocabstats.patch  # noqa: F401  (megatron-vocabstats: --vocab-parallel-stats)\n"


def add_import(text: str) -> str:
    """``text`` with :data:`LINE` after its first ``import torch`` line (unchanged if present)."""
    if "import megatron_vocabstats.patch" in text:
        return text
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == "import torch":
            return "".join(lines[: i + 1] + ["\n", LINE] + lines[i + 1 :])
    raise ValueError("no top-level 'import torch' line found: add the import by hand")


def main(path: str) -> None:
    with open(path) as f:
        text = f.read()
    new = add_import(text)
    if new == text:
        print(f"{path}: already imports megatron_vocabstats.patch")
        return
    with open(path, "w") as f:
        f.write(new)
    print(f"{path}: added '{LINE.strip()}'")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
