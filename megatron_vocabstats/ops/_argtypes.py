"""Python-type and range checks of scalar arguments, and the error they raise.

The one checker of number-like options and the one of bool options, used by every op, loss,
settings object and flag (made public by :mod:`.options`). Standard library only.
"""

from __future__ import annotations

import math
import numbers

INT64_RANGE = (-(2**63), 2**63 - 1)


class InputTypeError(TypeError, ValueError):
    """An argument of the wrong Python type. A ``TypeError``, and a ``ValueError`` too, so that
    code catching the ops' ``ValueError`` for bad input catches it as well."""


def _shown(value) -> str:
    """``repr(value)``, cut short for a huge int (``10**400`` has 401 digits)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def _is_bool(value) -> bool:
    # numpy's bool_ is no numbers.Integral, but a 0-d bool array-like is refused alike.
    return isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", "") == "b"


def _bound(x) -> str:
    if x == INT64_RANGE[1]:
        return "2**63 - 1"
    if x == INT64_RANGE[0]:
        return "-2**63"
    return f"{x:g}" if isinstance(x, float) else str(x)  # (str: an int, or a traced SymInt)


def describe_range(*, integer: bool = False, low=None, high=None, low_open: bool = False,
                   high_open: bool = False) -> str:
    """The rule of :func:`check_number` in words: ``"an int >= 1"``, ``"a finite number in (0,
    1]"``, ``"a finite number"``."""
    kind = "an int" if integer else "a finite number"
    if low is not None and high is not None:
        return (f"{kind} in {'(' if low_open else '['}{_bound(low)}, {_bound(high)}"
                f"{')' if high_open else ']'}")
    if low is not None and not low_open and isinstance(low, float) and 0 < low < 1e-30:
        # a floor just above 0 (temperature's, 1 / the largest fp32) reads as what it means
        return f"{kind} > 0 (at least {_bound(low)})"
    if low is not None:
        return f"{kind} {'>' if low_open else '>='} {_bound(low)}"
    if high is not None:
        return f"{kind} {'<' if high_open else '<='} {_bound(high)}"
    return kind


def number_problem(value, *, integer: bool = False, low=None, high=None, low_open: bool = False,
                   high_open: bool = False, finite: bool = True) -> tuple[type, str] | None:
    """:func:`check_number`'s verdict without a name or raising: ``(error class, "must be ...,
    got ...")`` or None (the message only composed for a problem: a bound may be a ``SymInt``)."""
    def problem(kind=ValueError, note=""):
        rule = describe_range(integer=integer, low=low, high=high, low_open=low_open,
                              high_open=high_open)
        if not finite:
            rule = rule.replace("a finite number", "a number") + " (or NaN, +-inf)"
        return kind, f"must be {rule}{note}, got {_shown(value)}"

    wanted = numbers.Integral if integer else numbers.Real
    if _is_bool(value) or not isinstance(value, wanted):
        kind, text = problem(InputTypeError)
        return kind, f"{text} ({type(value).__name__})"
    if isinstance(value, numbers.Integral):
        number = int(value)  # exact: a huge int is compared as it is, never through a float
    else:
        try:
            number = float(value)
        except (OverflowError, ValueError):
            return problem()
        if not math.isfinite(number):
            return problem() if finite else None
    too_low = low is not None and (number <= low if low_open else number < low)
    too_high = high is not None and (number >= high if high_open else number > high)
    if too_low or too_high:
        return problem()
    if not integer and isinstance(number, int):
        try:
            float(number)
        except OverflowError:  # no bound given, and beyond float64
            return problem(note=" (that fits a float64)")
    return None


def check_number(name: str, value, *, integer: bool = False, low=None, high=None,
                 low_open: bool = False, high_open: bool = False, none_ok: bool = False,
                 finite: bool = True):
    """The one checker of number-like options: ``value`` as an ``int`` (``integer``) or a
    ``float``, else an error ``"<name> must be <rule>, got <value>"``.

    Accepts any ``numbers.Real`` (``numbers.Integral`` with ``integer``): numpy numbers, a
    ``Fraction``. :class:`InputTypeError` for a bool (numpy's too), a tensor, a string, and with
    ``integer`` a float such as ``3.0``; ``ValueError`` for NaN, +-inf and values outside
    ``low``/``high`` (closed unless ``low_open``/``high_open``; None: unbounded), huge ints
    compared exactly, never through a float. ``none_ok``: None is returned as None (an option
    that is off). ``finite=False`` (a fill value): NaN and +-inf pass, finite values meet the
    range."""
    if value is None and none_ok:
        return None
    problem = number_problem(value, integer=integer, low=low, high=high, low_open=low_open,
                             high_open=high_open, finite=finite)
    if problem is not None:
        kind, text = problem
        if none_ok:
            text = text.replace(", got", " or None, got", 1)
        raise kind(f"{name} {text}")
    return int(value) if integer else float(value)


def check_integer(name: str, value) -> int:
    """``value`` as an int (any integral number but a bool), else :class:`InputTypeError`
    naming ``name``: :func:`check_number` with ``integer=True`` and no range."""
    return check_number(name, value, integer=True)


def check_real(name: str, value) -> float:
    """``value`` as a finite float (any real number but a bool; not a tensor), else an error
    naming ``name``: :func:`check_number` without a range."""
    return check_number(name, value)


def check_int64(name: str, value) -> int:
    """``int(value)``, else ``ValueError`` naming ``name`` if it does not fit int64."""
    value = int(value)
    if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
        raise ValueError(f"{name}={_shown(value)} does not fit int64")
    return value


def bool_error(name: str, value) -> InputTypeError | None:
    """The error of :func:`check_bool` for ``value`` (not raised), or None for a Python bool or
    numpy's ``bool_``: for checks that collect a rank's first problem before raising."""
    kind = type(value)
    if isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool",
                                                                                 "bool_")):
        return None
    return InputTypeError(f"{name} must be a bool, got {_shown(value)} ({kind.__name__})")


def check_bool(name: str, value) -> bool:
    """The one checker of bool options: a Python bool or numpy's ``bool_`` as a bool; anything
    else (0 and 1, a tensor, a string, None) raises :class:`InputTypeError` ``"<name> must be a
    bool, got <value> (<type>)"``."""
    error = bool_error(name, value)
    if error is not None:
        raise error
    return bool(value)


def check_choice(name: str, value, choices: tuple) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is one of ``choices``
    (:class:`InputTypeError` when its type is not one of theirs, e.g. ``entropy=True``)."""
    try:
        ok = value in choices
    except Exception:  # noqa: BLE001 - e.g. a tensor or an unhashable value: not a choice
        ok = False
    if not ok:
        wrong_type = not isinstance(value, tuple({type(c) for c in choices}))
        raise (InputTypeError if wrong_type else ValueError)(
            f"{name} must be one of {choices}, got {_shown(value)}")
