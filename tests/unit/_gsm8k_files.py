"""Tiny GSM8K input files for the example's tests (``test_example_gsm8k.py``,
``test_example_gsm8k_cli.py``; ``conftest.py``'s ``gsm8k_dir`` fixture writes a folder of them)."""

from __future__ import annotations

import json

ROW = {"question": "Tom has 3 apples and eats 1. How many are left?",
       "answer": "He has 3 - 1 = <<3-1=2>>2 left.\nSo 2 apples.\n#### 2"}
# A tiny model, in the example's flags.
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "384"]


def write_jsonl(path, rows, raw="") -> str:
    """Write ``rows`` to ``path`` as JSON lines, then ``raw``; returns the path as a str."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + raw)
    return str(path)

