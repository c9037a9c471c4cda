"""The shape spelling every analysis script takes: B<batch>T<time>H<heads>D<head dim>, e.g. B1T32768H16D128."""
from __future__ import annotations

import re


def bthd(text: str) -> tuple[int, int, int, int]:
    """(B, T, H, D) of a shape spelled B1T32768H16D128."""
    match = re.fullmatch(r"B(\d+)T(\d+)H(\d+)D(\d+)", text)
    if match is None:
        raise SystemExit(f"shape {text!r}: expected B<batch>T<time>H<heads>D<head dim>, e.g. B1T32768H16D128")
    return tuple(int(x) for x in match.groups())
