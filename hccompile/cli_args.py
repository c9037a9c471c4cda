"""Argument parsing shared by the console script's commands (hccompile/cli.py) and the demo
(hccompile/demo.py, which cli runs): one-line errors, checked integers and devices."""
from __future__ import annotations

import argparse


class UsageError(Exception):
    """A bad argument found after parsing (a file, a device): one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line naming the command and pointing at --help."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def device_arg(text: str) -> str:
    """'cpu', 'cuda' or 'cuda:N', checked against what this machine has."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cpu or cuda)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "a CPU build of torch" if torch.version.cuda is None else "no GPU visible"
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here ({why}; "
                                             f"torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text!r}: hccompile runs on cpu or cuda")
    return text
