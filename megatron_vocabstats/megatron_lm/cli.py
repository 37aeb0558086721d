"""``vocabstats-patch-megatron`` (also ``python -m megatron_vocabstats.megatron_lm``): add the
plugin's import to a Megatron-LM checkout's ``pretrain_gpt.py`` (usage and exit status:
docs/megatron.md).
"""

from __future__ import annotations

import argparse
import os
import sys

from . import releases
from .inserter import LINE, add_import, has_import

PROG = "vocabstats-patch-megatron"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Add `import megatron_vocabstats.patch` to a Megatron-LM "
        "checkout's pretrain_gpt.py with the patch shipped for its release.")
    parser.add_argument("megatron_lm", nargs="?", help="path of the Megatron-LM checkout")
    parser.add_argument("--check", action="store_true",
                        help="only verify that the patch applies (or is applied); write nothing")
    parser.add_argument("--insert", action="store_true",
                        help="no patch: add the line after the script's first `import torch` "
                        "(any release, or a script you edited)")
    parser.add_argument("--release", choices=sorted(releases.RELEASES),
                        help="use this release's patch instead of the checkout's own release")
    parser.add_argument("--list", action="store_true",
                        help="list the shipped patches (path, release tag, commit) and exit")
    return parser


def _list() -> int:
    for release, (tag, commit) in releases.RELEASES.items():
        print(f"{release}: {releases.patch_path(release)}  (made from {tag}, {commit[:12]})")
    return 0


def run(argv=None) -> tuple[int, str]:
    """The command: ``(exit status, message)``, the script written unless ``--check``. Raises
    ``ValueError`` for bad input and ``OSError`` when the script cannot be read or written."""
    args = _parser().parse_args(argv)
    if args.list:
        return _list(), ""
    if args.megatron_lm is None:
        raise ValueError("give the path of a Megatron-LM checkout (or --list)")
    script = os.path.join(args.megatron_lm, releases.SCRIPT)
    if not os.path.isfile(script):
        raise ValueError(f"{script} does not exist: is {args.megatron_lm} a Megatron-LM checkout?")
    with open(script, encoding="utf-8") as f:
        text = f.read()
    if has_import(text):
        return 0, f"{script}: already imports megatron_vocabstats.patch; nothing to do"
    if args.insert:
        new, how = add_import(text), "inserted the line after `import torch`"
    else:
        release = args.release or releases.release_of(args.megatron_lm)
        if release not in releases.RELEASES:
            raise ValueError(
                f"{args.megatron_lm} is Megatron-LM {release} (megatron/core/package_info.py); "
                f"patches ship for {', '.join(releases.RELEASES)}: add --insert to put the line "
                "after the script's `import torch` instead (the same change)")
        patch = releases.patch_path(release)
        with open(patch, encoding="utf-8") as f:
            try:
                new = releases.apply_to_text(f.read(), text)
            except ValueError as exc:
                return 1, (f"{script}: {os.path.basename(patch)} does not apply: {exc}; "
                           f"nothing written. --insert adds the line after `import torch` instead")
        tag, commit = releases.RELEASES[release]
        how = f"{os.path.basename(patch)} (made from {tag}, {commit[:12]})"
    if args.check:
        return 0, f"{script}: {how} applies; nothing written (--check)"
    with open(script, "w", encoding="utf-8") as f:
        f.write(new)
    return 0, f"{script}: {how}: added '{LINE.strip()}'"


def main(argv=None) -> int:
    try:
        code, message = run(argv)
    except (ValueError, OSError) as exc:  # bad input, or a script it cannot read or write
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if message:
        print(message)
    return code


if __name__ == "__main__":
    sys.exit(main())
