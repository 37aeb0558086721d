"""Every fenced Python block of README.md, docs/*.md and examples/README.md runs as written.

The marking convention (README, "Conventions"), read from a block's first line:

* ``# needs a GPU`` (anything may follow): compiled here; run only where CUDA is available.
* ``# fragment: <what it needs>``: a piece of a running Megatron job (a ``forward_step``, names
  your training script defines): compiled here, never run.
* any other first line: run as written.

The runnable blocks run in ONE interpreter (one import of torch and Megatron for all), each
with fresh globals, in document order, from the repository root; a block that raises fails its
own test with the traceback. About 10 s of CPU.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md", "examples/README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
GPU, FRAGMENT = "# needs a GPU", "# fragment:"
# A fence may be indented (inside a list item); its body is dedented.
FENCE = re.compile(r"^([ \t]*)```python[^\n]*\n(.*?)^\1```", re.S | re.M)

RUNNER = r"""
import json, sys, traceback
with open(sys.argv[1]) as f:
    blocks = json.load(f)
results = {}
for name, code in blocks:
    try:
        exec(compile(code, name, "exec"), {"__name__": "__doc_snippet__"})
        results[name] = None
    except BaseException:  # noqa: BLE001 - every failure is the block's result
        results[name] = traceback.format_exc(limit=-3)
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""


def _blocks() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            out.append((f"{doc}:{line}", textwrap.dedent(match.group(2))))
    return out


BLOCKS = _blocks()


def _kind(code: str) -> str:
    first = code.lstrip("\n").split("\n", 1)[0]
    if first.startswith(GPU):
        return "gpu"
    if first.startswith(FRAGMENT):
        return "fragment"
    return "run"


def _runs_here(code: str) -> bool:
    return _kind(code) == "run" or (_kind(code) == "gpu" and torch.cuda.is_available())


@functools.cache
def _results() -> dict:
    runnable = [(name, code) for name, code in BLOCKS if _runs_here(code)]
    with tempfile.TemporaryDirectory() as tmp:
        blocks, results = os.path.join(tmp, "blocks.json"), os.path.join(tmp, "results.json")
        with open(blocks, "w") as f:
            json.dump(runnable, f)
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-c", RUNNER, blocks, results], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        if not os.path.exists(results):
            raise AssertionError(f"the snippet runner exited {proc.returncode}:\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(results) as f:
            return json.load(f)


def test_there_are_blocks_and_each_is_marked_or_runs():
    assert len(BLOCKS) >= 10, [name for name, _ in BLOCKS]
    for name, code in BLOCKS:
        first = code.lstrip("\n").split("\n", 1)[0]
        if first.startswith("#") and ("GPU" in first or "fragment" in first.lower()):
            assert _kind(code) != "run", f"{name}: write the marker as {GPU!r} or {FRAGMENT!r}"


@pytest.mark.parametrize("name, code", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_block(name, code):
    compile(code, name, "exec")  # every block, marked or not, is valid Python
    if not _runs_here(code):
        pytest.skip(f"marked {_kind(code)}: compiled only")
    error = _results()[name]
    assert error is None, f"{name} fails as written:\n{error}"
