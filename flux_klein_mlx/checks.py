"""The generic checkers of settings, on the bottom floor beside `errors` (the one module it imports):
every wing refuses a bad value with them (`RunSettings`, `TrainSettings`, the server's forms, dtype and
layout names, the lr schedule, the noise kind, the prompt the CLI and the server take). Each refuses
one value with one line (FluxKleinError) and changes nothing."""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable

from .errors import FluxKleinError


def is_int(v) -> bool:
    """A whole number that is not a bool (Python or numpy integers)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_finite(v) -> bool:
    """A real number within a float's range (an integer past it, 10**400, is not: it becomes no float)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def check_whole(name: str, value, low: int | None = None, high: int | None = None) -> None:
    """A whole number (not a bool) in [low, high]; either bound may be left out."""
    if is_int(value) and (low is None or low <= value) and (high is None or value <= high):
        return
    if low is not None and high is not None:
        raise FluxKleinError(f"{name} must be a whole number in [{low}, {high}], not {value!r}")
    if low is not None:
        raise FluxKleinError(f"{name} must be a whole number of at least {low}, not {value!r}")
    raise FluxKleinError(f"{name} must be a whole number, not {value!r}")


def check_number(
    name: str, value, low: float, *, high: float | None = None, open_low: bool = False, hint: str = ""
) -> None:
    """A finite real number (not a bool) from `low` (excluded if `open_low`) to `high` (no bound if None)."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and is_finite(value)
    ok = ok and (low < value if open_low else low <= value) and (high is None or value <= high)
    if ok:
        return
    if high is None:
        raise FluxKleinError(f"{name} must be a finite number {'>' if open_low else '>='} {low}{hint}, not {value!r}")
    bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
    raise FluxKleinError(f"{name} must be a number in {bound}{hint}, not {value!r}")


def check_choice(name: str, value, choices) -> None:
    """One of `choices` (named in the message in their order; a dict's keys)."""
    if not isinstance(value, Hashable) or value not in choices:  # a list is no choice (nor a key of a dict)
        raise FluxKleinError(f"{name} must be one of {', '.join(choices)}, not {value!r}")


def check_prompt_given(prompt) -> None:
    """The CLI and the server refuse an empty prompt alike (an unset shell variable, an empty form
    field); the Python API, like diffusers, takes "" as an unconditional prompt."""
    if isinstance(prompt, str) and not prompt.strip():
        raise FluxKleinError('the prompt is empty: describe the image to make (e.g. "a red fox in fresh snow")')
