"""`hccompile` console script."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hccompile demo [options]   (hccompile demo --help for the options)")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    print(f"hccompile: unknown command {cmd!r}; known: demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
