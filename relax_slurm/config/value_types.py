"""Check the value of a `key=value` override against its schema field's type before Hydra
composes, so `trainer.lr=abc` says what the key takes and shows a value that works, instead of
OmegaConf's "Value 'abc' of type 'str' could not be converted to Float".

Only numbers and booleans are checked: strings, lists and dicts take Hydra's grammar as they
are. Interpolations (`${...}`) and `null` (for Optional fields) pass.
"""

from __future__ import annotations

import re
import typing
from typing import Any

BOOL_WORDS = ("true", "false", "yes", "no", "on", "off", "y", "n", "1", "0")
"""What OmegaConf converts to a bool (any case)."""
_INT = re.compile(r"^[+-]?\d[\d_]*$")
EXAMPLES = {int: 1, float: 0.001, bool: "true"}
NAMES = {int: "an integer (int)", float: "a number (float)", bool: "true or false (bool)"}


def leaf_type(annotation: Any) -> tuple[type | None, bool]:
    """(int/float/bool or None for anything else, whether null is allowed)."""
    args = typing.get_args(annotation)
    optional = typing.get_origin(annotation) is typing.Union and type(None) in args
    if optional:
        rest = [a for a in args if a is not type(None)]
        annotation = rest[0] if len(rest) == 1 else None
    return (annotation if annotation in (int, float, bool) else None), optional


def fits(value: str, kind: type, optional: bool) -> bool:
    v = value.strip()
    if v.startswith("${") or (optional and v.lower() in ("null", "none", "~")):
        return True
    if kind is bool:
        return v.lower() in BOOL_WORDS
    if kind is int:
        return bool(_INT.match(v))
    try:
        float(v)
    except ValueError:
        return False
    return True


def type_error(key: str, value: str, annotation: Any, default: Any) -> str | None:
    """The message for a value that cannot be the field's type, None when it fits (or the
    field is of a type not checked here)."""
    kind, optional = leaf_type(annotation)
    if kind is None or fits(value, kind, optional):
        return None
    example = default if isinstance(default, kind) and default is not None else EXAMPLES[kind]
    if kind is bool:
        example = str(example).lower()
    null = " or null" if optional else ""
    return (f"{key}={value}: {key} takes {NAMES[kind]}{null}, e.g. {key}={example}"
            + (" (its default)" if example == default or str(example) == str(default).lower()
               else ""))
