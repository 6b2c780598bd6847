"""Checks of config values shared by the config classes and the environments, so that each says the same thing."""

from __future__ import annotations

import math
import numbers

__all__ = ["check_finite"]


def check_finite(name: str, value) -> None:
    """Refuse anything but a finite real number (a bool is not one), naming the field `name`."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}.")
