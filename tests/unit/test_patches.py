"""patches/: the import inserter, the per-release pretrain_gpt.py patches and their checker agree.

Whether each patch applies exactly to its release is checked against a Megatron-LM clone by
``python patches/check_patches.py /path/to/Megatron-LM`` (no network here); these tests check
that every patch is the inserter's own change, records its upstream commit, and has no fuzz room.
"""

import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCHES = os.path.join(ROOT, "patches")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(PATCHES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


inserter = _load("add_vocabstats_import")
checker = _load("check_patches")


def test_inserter_adds_the_line_once_after_import_torch():
    script = '"""Pretrain GPT."""\nimport os\nimport torch\nfrom megatron.training import pretrain\n'
    once = inserter.add_import(script)
    assert once.splitlines()[3] == "" and once.splitlines()[4] == inserter.LINE.rstrip("\n")
    assert inserter.add_import(once) == once
    with pytest.raises(ValueError, match="import torch"):
        inserter.add_import("import os\n")


def test_one_patch_per_supported_release():
    shipped = sorted(f for f in os.listdir(PATCHES) if f.endswith(".patch"))
    assert shipped == [f"pretrain_gpt.core_v{r}.patch" for r in ("0.16", "0.17", "0.18", "0.19")]
    assert sorted(checker.RELEASES) == ["0.16", "0.17", "0.18", "0.19"]


def _hunk(text):
    """(old start, old lines, new lines) of the patch's single hunk."""
    lines = text.splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.startswith("@@")]
    assert len(at) == 1, "one hunk per patch"
    start = int(re.match(r"@@ -(\d+),", lines[at[0]]).group(1))
    old = [line[1:] for line in lines[at[0] + 1:] if line[0] in " -"]
    new = [line[1:] for line in lines[at[0] + 1:] if line[0] in " +"]
    return start, old, new


@pytest.mark.parametrize("release", ["0.16", "0.17", "0.18", "0.19"])
def test_patch_is_the_inserters_change_and_records_its_commit(release):
    with open(checker.patch_path(release)) as f:
        text = f.read()
    tag, commit = checker.RELEASES[release]
    assert text.startswith(checker.header(release))
    assert f"{tag} ({commit})" in text and re.fullmatch(r"[0-9a-f]{40}", commit)
    start, old, new = _hunk(text)
    added = [line[1:] for line in text.splitlines(keepends=True)
             if line.startswith("+") and not line.startswith("+++")]
    assert added == ["\n", inserter.LINE] or added == [inserter.LINE, "\n"]
    # Full context on both sides (3 lines): git apply needs no fuzz, and the hunk rebuilt by the
    # inserter from its own pre-image is the shipped post-image.
    assert len(old) == 6 and start > 1
    assert inserter.add_import("".join(old)) == "".join(new)


def test_make_patch_round_trip():
    original = "".join(f"import x{i}\n" for i in range(5)) + "import torch\n" + "y = 1\n" * 5
    patch = checker.make_patch("0.19", original)
    start, old, new = _hunk(patch)
    assert "".join(old) in original and inserter.add_import("".join(old)) == "".join(new)
