"""Checks of config values shared by the config classes and the environments, so that each says the same thing."""

from __future__ import annotations

import math
import numbers

__all__ = ["check_finite", "check_integer"]


def check_finite(name: str, value) -> None:
    """Refuse anything but a finite real number (a bool is not one), naming the field `name`."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}.")


def check_integer(name: str, value, minimum: int | None = None, what: str | None = None) -> None:
    """Refuse anything but an integer >= `minimum` (a bool is not one: YAML's `yes` would pass as 1), naming `name`."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or (minimum is not None and value < minimum):
        if what is None:
            named = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}
            what = named.get(minimum, f"an integer >= {minimum}")
        raise ValueError(f"`{name}` must be {what}, got {value!r}.")
