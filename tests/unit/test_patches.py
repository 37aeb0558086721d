"""patches/: the import inserter and the shipped pretrain_gpt.py patch agree."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inserter():
    path = os.path.join(ROOT, "patches", "add_vocabstats_import.py")
    spec = importlib.util.spec_from_file_location("add_vocabstats_import", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_inserter_adds_the_line_once_after_import_torch():
    mod = _inserter()
    script = '"""Pretrain GPT."""\nimport os\nimport torch\nfrom megatron.training import pretrain\n'
    once = mod.add_import(script)
    assert once.splitlines()[3] == "" and once.splitlines()[4] == mod.LINE.rstrip("\n")
    assert mod.add_import(once) == once
    with pytest.raises(ValueError, match="import torch"):
        mod.add_import("import os\n")


def test_shipped_patch_adds_the_same_line():
    mod = _inserter()
    with open(os.path.join(ROOT, "patches", "pretrain_gpt.core_v0.19.patch")) as f:
        added = [line[1:] for line in f if line.startswith("+") and not line.startswith("+++")]
    assert mod.LINE in added
