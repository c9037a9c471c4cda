"""Argument errors raised while torch.compile traces an op: sizes there are symbols.

Under torch.compile the ops' checks run on fake tensors whose sizes are symbols (`s81`), so a
message such as "v: batch, time, heads (1, s81, s0) differ from q's (1, s34, s0)" names no value
and no dimension. `symbols_explained` re-raises such an error with each symbol replaced by its value
in this call and a note of what it stands for ("v.shape[1] is s81 = 33"). Reading a symbol's value
(its hint) adds no guard. Messages without symbols pass through untouched.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable

import torch

from ..compat import size_hint

_SYMBOL = re.compile(r"\b[su]\d+\b")


def _symbols_of(arguments: dict[str, Any]) -> dict[str, tuple[str, int | None]]:
    """symbol name -> (the first argument size it is, e.g. "v.shape[1]"; its value, None if unknown)."""
    found: dict[str, tuple[str, int | None]] = {}

    def note(size: Any, where: str) -> None:
        if not isinstance(size, (torch.SymInt, torch.SymFloat)):
            return
        node = size.node
        if not getattr(node.expr, "is_Symbol", False) or str(node.expr) in found:
            return
        try:
            value = size_hint(size)
        except Exception:  # noqa: BLE001 - an unbacked size has no example value
            value = None
        found[str(node.expr)] = (where, value)

    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                note(size, f"{name}.shape[{dim}]")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    for dim, size in enumerate(item.shape):
                        note(size, f"{name}[{i}].shape[{dim}]")
                else:
                    note(item, f"{name}[{i}]")
        else:
            note(value, name)
    return found


EXPLAINED = "under torch.compile sizes are symbols:"


def explain_symbols(message: str, arguments: dict[str, Any]) -> str | None:
    """`message` with the symbols of `arguments`' sizes replaced by their values and explained, or
    None when it names none of them or was explained already (an op's body calling its host twin)."""
    if EXPLAINED in message:
        return None
    symbols = _symbols_of(arguments)
    named = [s for s in dict.fromkeys(_SYMBOL.findall(message)) if s in symbols]
    if not named:
        return None
    text = _SYMBOL.sub(lambda m: str(symbols[m.group()][1]) if symbols.get(m.group(), ("", None))[1] is not None
                       else m.group(), message)
    notes = []
    for symbol in named:
        where, value = symbols[symbol]
        notes.append(f"{where} is {symbol}" + (f" = {value} in this call" if value is not None else ""))
    return f"{text} ({EXPLAINED} {'; '.join(notes)})"


def reraise_explained(error: Exception, signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
    """Raises `error` again: the same type with its symbols explained when it names symbolic sizes of
    the call's arguments, else `error` itself. Call it from an `except` clause."""
    try:
        arguments = signature.bind(*args, **kwargs).arguments
    except TypeError:
        arguments = {}
    text = explain_symbols(str(error), arguments) if isinstance(error, (ValueError, TypeError)) else None
    if text is None:
        raise error
    raise type(error)(text) from None


def symbols_explained(fn: Callable) -> Callable:
    """Wraps an op's fake: a ValueError or TypeError naming symbolic sizes of its arguments is raised
    again, same type, with the symbols explained (explain_symbols)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as error:
            reraise_explained(error, signature, args, kwargs)

    return wrapper
