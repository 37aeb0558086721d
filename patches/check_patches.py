"""Check (or regenerate) the per-release ``pretrain_gpt.py`` patches against a Megatron-LM clone.

    python patches/check_patches.py /path/to/Megatron-LM            # git apply --check, each release
    python patches/check_patches.py /path/to/Megatron-LM --write    # rewrite the patch files

Each ``pretrain_gpt.core_v0.NN.patch`` records the release tag and upstream commit it was made
from (its first lines; ``git apply`` and ``patch`` skip them). ``--write`` makes each patch from
that commit's ``pretrain_gpt.py`` with :func:`add_vocabstats_import.add_import`, so the patches and
the inserter can never disagree; the check extracts the file at the recorded commit into a
temporary directory and runs ``git apply --check`` there (exact context, no fuzz). Exit status 1
when a patch does not apply.
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from add_vocabstats_import import add_import  # noqa: E402

SCRIPT = "pretrain_gpt.py"
# release -> (Megatron-LM tag, commit of that tag). The newest patch release of each line.
RELEASES = {
    "0.16": ("core_v0.16.1", "55ac7082517c3878ae653c07c09c534b8aed49f6"),
    "0.17": ("core_v0.17.1", "266f1c97dca477ca8b92c16087506da2000b0b84"),
    "0.18": ("core_v0.18.2", "571370c829ca768fe37244f4e2e7f28d8accc4ab"),
    "0.19": ("core_v0.19.0", "5be9626709af2722333bf54797c954c09edeada3"),
}


def patch_path(release: str) -> str:
    return os.path.join(HERE, f"pretrain_gpt.core_v{release}.patch")


def header(release: str) -> str:
    tag, commit = RELEASES[release]
    return (f"megatron-vocabstats: add the plugin's import to Megatron-LM {SCRIPT}, release {release}\n"
            f"made from: {tag} ({commit})\n"
            f"check: python patches/check_patches.py /path/to/Megatron-LM\n\n")


def make_patch(release: str, original: str) -> str:
    """The patch of ``original`` (``pretrain_gpt.py`` of ``release``) that :func:`add_import` makes."""
    diff = difflib.unified_diff(original.splitlines(keepends=True),
                                add_import(original).splitlines(keepends=True),
                                f"a/{SCRIPT}", f"b/{SCRIPT}", n=3)
    return header(release) + "".join(diff)


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
