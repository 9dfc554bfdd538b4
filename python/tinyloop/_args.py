"""Checks of Python arguments before they reach C.

Wrong types raise TypeError naming what was given; values that are obviously out of
range raise ValueError. Anything subtler is left to the library, whose errors carry
its own message.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

_INT32_MAX = 2**31 - 1


def integer(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    # bool is an int subclass, but `depth=True` is always a mistake
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    number = int(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {number}")
    return number


def boolean(name: str, value: Any) -> bool:
    # an int is not a bool here: `logprobs=1` is as likely a mistake as a wish
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def real(name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
         exclusive_minimum: bool = False, exclusive_maximum: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    number = float(value)
    if number != number:
        raise ValueError(f"{name} must not be NaN")
    if minimum is not None:
        if exclusive_minimum and number <= minimum:
            raise ValueError(f"{name} must be > {minimum}, got {number}")
        if number < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None:
        if number > maximum:
            raise ValueError(f"{name} must be <= {maximum}, got {number}")
        if exclusive_maximum and number == maximum:
            raise ValueError(f"{name} must be < {maximum}, got {number}")
    return number


def token_array(tokens: Any, vocab_size: int, *, name: str = "tokens",
                min_length: int = 1) -> np.ndarray:
    """A 1-D C-contiguous int32 array of token ids.

    An int32 C-contiguous numpy array is returned as is (no copy); other integer
    arrays and sequences are converted. Floats, bools and objects raise TypeError."""
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of token ids, got {type(tokens).__name__}; "
                        "encode text with model.tokenizer first")
    if isinstance(tokens, np.ndarray):
        array = tokens
    else:
        try:
            items = list(tokens)
        except TypeError:
            raise TypeError(f"{name} must be a sequence of token ids, "
                            f"got {type(tokens).__name__}") from None
        for item in items:
            if isinstance(item, bool) or not isinstance(item, numbers.Integral):
                raise TypeError(f"{name} must hold ints, got an element of type "
                                f"{type(item).__name__}")
        array = np.array(items, dtype=np.int64) if items else np.zeros(0, dtype=np.int32)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if len(array) < min_length:
        raise ValueError(f"{name} must hold at least {min_length} token(s), got {len(array)}")
    if len(array):
        low, high = int(array.min()), int(array.max())
        if low < 0:
            raise ValueError(f"{name}: token id {low} is negative")
        if high >= vocab_size:
            raise ValueError(f"{name}: token id {high} is out of range for vocab size "
                             f"{vocab_size}")
    if array.dtype == np.int32 and array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array, dtype=np.int32)


def max_int32(name: str, value: Any) -> int:
    return integer(name, value, minimum=0, maximum=_INT32_MAX)
