"""Checks of the plain arguments every public entry point takes, made before anything is read or
written: Python would otherwise let a truthy string stand for True (`overwrite="false"` deleting a
checkpoint) and a float stand for a count until it fails deep inside, after a destination was
touched."""

from __future__ import annotations

import numpy as np

from ragckpt.errors import OptionError


def check_flag(name: str, value: object) -> None:
    """A flag that decides whether a checkpoint is replaced must be a real bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_count(name: str, value: object, *, minimum: int = 1, optional: bool = False) -> None:
    """An integer of at least `minimum` (None too when `optional`)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise OptionError(f"{name} must be an integer of at least {minimum}, got {value!r}")
