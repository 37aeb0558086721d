"""The shipped per-release ``pretrain_gpt.py`` patches (:func:`.inserter.add_import`'s change of
a recorded commit's script, one hunk): which release each fits, applying one; ``python -m
megatron_vocabstats.megatron_lm.releases /path/to/Megatron-LM [--write]`` checks them.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from .inserter import add_import

SCRIPT = "pretrain_gpt.py"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# release -> (Megatron-LM tag, its commit): the newest patch release of each line; a line not
# yet tagged names the branch (``main``) and the commit the patch was made from.
RELEASES = {
    "0.16": ("core_v0.16.1", "55ac7082517c3878ae653c07c09c534b8aed49f6"),
    "0.17": ("core_v0.17.1", "266f1c97dca477ca8b92c16087506da2000b0b84"),
    "0.18": ("core_v0.18.2", "571370c829ca768fe37244f4e2e7f28d8accc4ab"),
    "0.19": ("core_v0.19.0", "5be9626709af2722333bf54797c954c09edeada3"),
    "0.20": ("main", "d98e8a64ddf34856e74b24714e3bedb2f5a39553"),
}
PACKAGE_INFO = os.path.join("megatron", "core", "package_info.py")


def patches_dir() -> str:
    """The shipped patches' folder: ``patches/`` next to this module (a wheel), else the
    repository's (a source checkout); ``FileNotFoundError`` naming both when neither exists."""
    installed, source = os.path.join(HERE, "patches"), os.path.join(REPO, "patches")
    if os.path.isdir(installed):
        return installed
    # Only beside the repository's pyproject.toml: an installed package without its patches is
    # not rescued by some other project's site-packages/patches.
    if os.path.isdir(source) and os.path.isfile(os.path.join(REPO, "pyproject.toml")):
        return source
    raise FileNotFoundError(f"the pretrain_gpt.py patches are in neither {installed} (an "
                            f"installed wheel) nor {source} (a source checkout): reinstall "
                            "megatron-vocabstats")


def patch_path(release: str) -> str:
    """Path of the shipped patch of ``release`` (``"0.19"``); it may not exist for others."""
    return os.path.join(patches_dir(), f"pretrain_gpt.core_v{release}.patch")


def header(release: str) -> str:
    tag, commit = RELEASES[release]
    return (f"megatron-vocabstats: add the plugin's import to Megatron-LM {SCRIPT}, "
            f"release {release}\n"
            f"made from: {tag} ({commit})\n"
            f"check: python -m megatron_vocabstats.megatron_lm.releases /path/to/Megatron-LM\n\n")


def make_patch(release: str, original: str) -> str:
    """The patch :func:`add_import` makes of ``original``, ``release``'s ``pretrain_gpt.py``."""
    diff = difflib.unified_diff(original.splitlines(keepends=True),
                                add_import(original).splitlines(keepends=True),
                                f"a/{SCRIPT}", f"b/{SCRIPT}", n=3)
    return header(release) + "".join(diff)


@dataclass(frozen=True)
class Hunk:
    """The single hunk of a shipped patch: its 1-based start line, old and new lines."""

    start: int
    old: tuple[str, ...]
    new: tuple[str, ...]


def read_hunk(text: str) -> Hunk:
    """The one hunk of the patch ``text``; ``ValueError`` unless it has exactly one."""
    lines = text.splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.startswith("@@")]
    if len(at) != 1:
        raise ValueError(f"a shipped patch has one hunk, this one has {len(at)}")
    match = re.match(r"@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@", lines[at[0]])
    if match is None:
        raise ValueError(f"not a unified-diff hunk header: {lines[at[0]]!r}")
    body = [line for line in lines[at[0] + 1:] if line[:1] in (" ", "-", "+")]
    old = tuple(line[1:] for line in body if line[0] in " -")
    new = tuple(line[1:] for line in body if line[0] in " +")
    return Hunk(int(match.group(1)), old, new)


def apply_to_text(patch: str, text: str) -> str:
    """``text`` with the patch's hunk applied as ``git apply`` does without fuzz (the occurrence
    nearest the stated line); ``ValueError`` when the pre-image does not occur exactly."""
    hunk = read_hunk(patch)
    lines = text.splitlines(keepends=True)
    n = len(hunk.old)
    found = [i for i in range(len(lines) - n + 1) if tuple(lines[i:i + n]) == hunk.old]
    if not found:
        raise ValueError(f"the patch's {n} lines of context are not in the script (another "
                         "release, or an edited script)")
    i = min(found, key=lambda j: abs(j - (hunk.start - 1)))
    return "".join(lines[:i] + list(hunk.new) + lines[i + n:])


def release_of(megatron_lm: str) -> str:
    """``"0.19"`` for a Megatron-LM checkout, from its ``megatron/core/package_info.py``;
    ``ValueError`` naming the file when it is missing or has no ``MAJOR``/``MINOR``."""
    path = os.path.join(megatron_lm, PACKAGE_INFO)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"{path} cannot be read ({exc.strerror}): is {megatron_lm} a Megatron-LM "
                         "checkout?") from None
    parts = [re.search(rf"^{name}\s*=\s*(\d+)", text, re.M) for name in ("MAJOR", "MINOR")]
    if not all(parts):
        raise ValueError(f"{path} has no MAJOR / MINOR version numbers")
    return ".".join(p.group(1) for p in parts)


def upstream_script(megatron_lm: str, commit: str) -> str:
    return subprocess.run(["git", "-C", megatron_lm, "show", f"{commit}:{SCRIPT}"], check=True,
                          capture_output=True, text=True).stdout


def check(megatron_lm: str, release: str) -> tuple[bool, str]:
    """``git apply --check`` of the shipped patch on the recorded commit's script."""
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, SCRIPT), "w") as f:
            f.write(upstream_script(megatron_lm, RELEASES[release][1]))
        proc = subprocess.run(["git", "apply", "--check", "-v", patch_path(release)], cwd=tmp,
                              capture_output=True, text=True)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_vocabstats.megatron_lm.releases",
                                     description="Check (or regenerate) the shipped "
                                     "pretrain_gpt.py patches against a Megatron-LM clone.")
    parser.add_argument("megatron_lm", help="a Megatron-LM git clone holding the release tags")
    parser.add_argument("--write", action="store_true", help="regenerate the patch files first")
    args = parser.parse_args(argv)
    ok = True
    for release, (tag, commit) in RELEASES.items():
        if args.write:
            with open(patch_path(release), "w") as f:
                f.write(make_patch(release, upstream_script(args.megatron_lm, commit)))
        applies, log = check(args.megatron_lm, release)
        ok &= applies
        print(f"{os.path.basename(patch_path(release))}: {tag} {commit[:12]}: "
              f"{'applies' if applies else 'DOES NOT APPLY'}")
        if not applies:
            print(log)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
