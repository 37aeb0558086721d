"""Python-type checks of the ops' scalar arguments, and the error they raise.

Lives here: :class:`InputTypeError` (a ``TypeError`` that is also a ``ValueError``),
:func:`check_integer`, :func:`check_real`, :func:`check_choice` and :func:`check_int64` (an int
that must fit the int64 columns of the cross-rank check exchange). The bottom of ``ops/``:
imports nothing of the package (only the standard library), so every other module,
:mod:`._comm` included, may import it.
"""

from __future__ import annotations

import numbers

INT64_RANGE = (-(2**63), 2**63 - 1)


class InputTypeError(TypeError, ValueError):
    """An argument of the wrong Python type. A ``TypeError``, and a ``ValueError`` too, so that
    code catching the ops' ``ValueError`` for bad input catches it as well."""


def check_integer(name: str, value) -> int:
    """``value`` as an int (any integral number but a bool), else :class:`InputTypeError`
    naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def check_real(name: str, value) -> float:
    """``value`` as a float (any real number but a bool; not a tensor), else
    :class:`InputTypeError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"{name} must be a real number (a Python float), got {value!r} "
                             f"({type(value).__name__})")
    return float(value)


def check_int64(name: str, value) -> int:
    """``int(value)``, else ``ValueError`` naming ``name`` if it does not fit int64."""
    value = int(value)
    if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
        raise ValueError(f"{name}={value} does not fit int64")
    return value


def check_choice(name: str, value, choices: tuple) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
