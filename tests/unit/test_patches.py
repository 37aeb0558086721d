"""megatron_vocabstats.megatron_lm: the import inserter, the per-release pretrain_gpt.py patches,
their applier and the ``vocabstats-patch-megatron`` command agree.

The patches live in the repository's top-level ``patches/`` (a wheel installs them as
``megatron_vocabstats/megatron_lm/patches/``: tests/unit/test_wheel.py); from this source tree
:func:`releases.patches_dir` must find that folder itself. Whether each patch applies exactly to
its release is checked against a Megatron-LM clone by
``python -m megatron_vocabstats.megatron_lm.releases /path/to/Megatron-LM`` (no network here);
these tests check that every patch is the inserter's own change, records its upstream commit and
has no fuzz room, and run the command on checkouts rebuilt from each patch's pre-image (the
release's own lines around ``import torch``), where ``git apply`` (when git is installed) and our
applier must write the same file.
"""

import os
import re
import shutil
import subprocess

import pytest

from megatron_vocabstats.megatron_lm import cli, inserter, releases

RELEASES = ("0.16", "0.17", "0.18", "0.19", "0.20")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCHES = os.path.join(ROOT, "patches")


def test_inserter_adds_the_line_once_after_import_torch():
    script = ('"""Pretrain GPT."""\nimport os\nimport torch\n'
              "from megatron.training import pretrain\n")
    once = inserter.add_import(script)
    assert once.splitlines()[3] == "" and once.splitlines()[4] == inserter.LINE.rstrip("\n")
    assert inserter.add_import(once) == once
    with pytest.raises(ValueError, match="import torch"):
        inserter.add_import("import os\n")


def test_one_patch_per_supported_release():
    shipped = sorted(f for f in os.listdir(PATCHES) if f.endswith(".patch"))
    assert shipped == [f"pretrain_gpt.core_v{r}.patch" for r in RELEASES]
    assert tuple(sorted(releases.RELEASES)) == RELEASES


def test_patches_readme_names_each_release():
    with open(os.path.join(PATCHES, "README.md"), encoding="utf-8") as f:
        rows = {line.split("|")[1].strip(" `"): line for line in f if line.startswith("| `")}
    assert sorted(rows) == [f"pretrain_gpt.core_v{r}.patch" for r in RELEASES]
    for release, (tag, commit) in releases.RELEASES.items():
        row = rows[f"pretrain_gpt.core_v{release}.patch"]
        assert f"| {release} " in row and f"`{tag}` ({commit[:12]})" in row, row


def test_the_source_tree_reads_the_top_level_patches():
    if not os.path.abspath(releases.__file__).startswith(ROOT + os.sep):
        pytest.skip(f"megatron_vocabstats is imported from {releases.__file__}, not this tree")
    assert os.path.samefile(releases.patches_dir(), PATCHES)
    for release in RELEASES:
        assert os.path.samefile(releases.patch_path(release),
                                os.path.join(PATCHES, f"pretrain_gpt.core_v{release}.patch"))
    # No second copy inside the package: the wheel's copy comes from pyproject.toml's mapping.
    inside = [os.path.join(d, f) for d, _, files in os.walk(os.path.dirname(releases.HERE))
              for f in files if f.endswith(".patch")]
    assert not inside, inside


def test_patches_dir_prefers_the_installed_copy(tmp_path, monkeypatch):
    package = tmp_path / "site" / "megatron_vocabstats" / "megatron_lm"
    repo = tmp_path / "site"
    monkeypatch.setattr(releases, "HERE", str(package))
    monkeypatch.setattr(releases, "REPO", str(repo))
    (repo / "patches").mkdir(parents=True)
    # A site-packages/patches of some other project is not ours (no pyproject.toml beside it).
    with pytest.raises(FileNotFoundError, match="reinstall"):
        releases.patches_dir()
    (repo / "pyproject.toml").write_text("")
    assert releases.patches_dir() == str(repo / "patches")  # a source checkout
    (package / "patches").mkdir(parents=True)
    assert releases.patches_dir() == str(package / "patches")  # an installed wheel, first
    assert releases.patch_path("0.19") == str(package / "patches" / "pretrain_gpt.core_v0.19.patch")


def _text(release):
    with open(releases.patch_path(release)) as f:
        return f.read()


@pytest.mark.parametrize("release", RELEASES)
def test_patch_is_the_inserters_change_and_records_its_commit(release):
    text = _text(release)
    tag, commit = releases.RELEASES[release]
    assert text.startswith(releases.header(release))
    assert f"{tag} ({commit})" in text and re.fullmatch(r"[0-9a-f]{40}", commit)
    # A release tag of its own line, or (a line not yet tagged) the branch it was made from.
    assert tag == "main" or tag.startswith(f"core_v{release}."), tag
    hunk = releases.read_hunk(text)
    added = [line[1:] for line in text.splitlines(keepends=True)
             if line.startswith("+") and not line.startswith("+++")]
    assert added == ["\n", inserter.LINE] or added == [inserter.LINE, "\n"]
    # Full context on both sides (3 lines): git apply needs no fuzz, and the hunk rebuilt by the
    # inserter from its own pre-image is the shipped post-image.
    assert len(hunk.old) == 6 and hunk.start > 1
    assert inserter.add_import("".join(hunk.old)) == "".join(hunk.new)


def test_make_patch_round_trip():
    original = "".join(f"import x{i}\n" for i in range(5)) + "import torch\n" + "y = 1\n" * 5
    hunk = releases.read_hunk(releases.make_patch("0.19", original))
    assert "".join(hunk.old) in original and inserter.add_import("".join(hunk.old)) == "".join(
        hunk.new)


def _checkout(root, release, *, script=None, minor=None):
    """A directory shaped like a Megatron-LM checkout of ``release``: package_info.py with its
    MAJOR/MINOR, and a pretrain_gpt.py holding the patch's pre-image at its stated line."""
    major, minor_ = release.split(".")
    os.makedirs(os.path.join(root, "megatron", "core"), exist_ok=True)
    with open(os.path.join(root, releases.PACKAGE_INFO), "w") as f:
        f.write(f"MAJOR = {major}\nMINOR = {minor if minor is not None else minor_}\nPATCH = 1\n")
    if script is None:
        hunk = releases.read_hunk(_text(release))
        filler = [f"# line {i}\n" for i in range(1, hunk.start)]
        script = "".join(filler) + "".join(hunk.old) + "pretrain()\n"
    with open(os.path.join(root, releases.SCRIPT), "w") as f:
        f.write(script)
    return os.path.join(root, releases.SCRIPT), script


@pytest.mark.parametrize("release", RELEASES)
def test_command_applies_the_release_patch_once(tmp_path, release, capsys):
    path, before = _checkout(tmp_path, release)
    assert cli.main([str(tmp_path), "--check"]) == 0
    assert "applies; nothing written" in capsys.readouterr().out
    assert open(path).read() == before
    assert cli.main([str(tmp_path)]) == 0
    after = open(path).read()
    assert after == inserter.add_import(before)
    assert f"pretrain_gpt.core_v{release}.patch" in capsys.readouterr().out
    assert cli.main([str(tmp_path)]) == 0 and "already imports" in capsys.readouterr().out
    assert cli.main([str(tmp_path), "--check"]) == 0 and open(path).read() == after
    if shutil.which("git"):  # git apply writes the same file as ours
        other = tmp_path / "git"
        git_path, _ = _checkout(other, release)
        subprocess.run(["git", "apply", releases.patch_path(release)], cwd=other, check=True)
        assert open(git_path).read() == after


def test_command_refuses_what_does_not_fit(tmp_path, capsys):
    # An edited script: the release's context is not there; nothing written, exit 1.
    path, before = _checkout(tmp_path, "0.19", script="import os\nimport torch\nmain()\n")
    assert cli.main([str(tmp_path), "--check"]) == 1
    assert cli.main([str(tmp_path)]) == 1
    assert "does not apply" in capsys.readouterr().out and open(path).read() == before
    # --insert makes the same change without a patch.
    assert cli.main([str(tmp_path), "--insert"]) == 0
    assert open(path).read() == inserter.add_import(before)
    # A release without a shipped patch names the ones that ship and --insert (exit 2).
    _checkout(tmp_path / "new", "0.21", script="import torch\n")
    assert cli.main([str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert "Megatron-LM 0.21" in err and "--insert" in err
    assert "0.16, 0.17, 0.18, 0.19, 0.20" in err
    # --release picks another release's patch; not a checkout at all: exit 2, named.
    _checkout(tmp_path / "rel", "0.19", minor=20)
    assert cli.main([str(tmp_path / "rel"), "--release", "0.19", "--check"]) == 0
    assert cli.main([str(tmp_path / "missing")]) == 2
    assert "pretrain_gpt.py does not exist" in capsys.readouterr().err
    (tmp_path / "noinfo").mkdir()
    (tmp_path / "noinfo" / releases.SCRIPT).write_text("import torch\n")
    assert cli.main([str(tmp_path / "noinfo")]) == 2
    assert "package_info.py cannot be read" in capsys.readouterr().err


def test_command_names_a_script_it_cannot_write(tmp_path, capsys, monkeypatch):
    path, before = _checkout(tmp_path, "0.19")
    real_open = open

    def read_only(file, mode="r", *args, **kwargs):
        if file == path and "w" in mode:
            raise PermissionError(13, "Permission denied", file)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", read_only)
    assert cli.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Permission denied" in err and path in err
    assert "Traceback" not in err and real_open(path).read() == before


def test_command_lists_the_shipped_patches(capsys):
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    for release, (tag, commit) in releases.RELEASES.items():
        assert releases.patch_path(release) in out and tag in out and commit[:12] in out
        assert os.path.isfile(releases.patch_path(release))
