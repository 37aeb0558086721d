"""Reversible attribute replacement with markers: applying twice is a no-op, removal is exact.
:data:`PATCHER` lives here, not in ``patch``, so that reloading that module keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

MARKER = "_megatron_vocabstats_patch"
_ABSENT = object()


@dataclass(frozen=True)
class Replacement:
    owner: object
    name: str
    original: object  # _ABSENT if the name was not set on the owner itself (inherited)


class Patcher:
    """Records replacements so that :meth:`remove_all` restores every original object."""

    def __init__(self):
        self.applied: list[Replacement] = []

    @staticmethod
    def is_ours(obj) -> bool:
        return getattr(obj, MARKER, False) is True

    def replace(self, owner, name: str, make_replacement) -> bool:
        """Bind ``make_replacement(current)`` as ``owner.name`` unless ours; True if patched."""
        current = getattr(owner, name)
        if self.is_ours(current):
            return False
        replacement = make_replacement(current)
        replacement.__wrapped__ = current
        setattr(replacement, MARKER, True)
        own = vars(owner).get(name, _ABSENT) if hasattr(owner, "__dict__") else current
        self.applied.append(Replacement(owner, name, own))
        setattr(owner, name, replacement)
        return True

    def remove_all(self) -> list[str]:
        """Restore every original, newest first; returns the names restored."""
        restored = []
        while self.applied:
            rec = self.applied.pop()
            if rec.original is _ABSENT:
                delattr(rec.owner, rec.name)
            else:
                setattr(rec.owner, rec.name, rec.original)
            restored.append(describe(rec.owner, rec.name))
        return restored

    def names(self) -> list[str]:
        return [describe(r.owner, r.name) for r in self.applied]


def describe(owner, name: str) -> str:
    """``module.Class.name`` for a class attribute, ``module.name`` for a module attribute."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{getattr(owner, '__name__', repr(owner))}.{name}"


PATCHER = Patcher()
