"""One benchmark on two trees of hccompile, one after the other on the same machine, for the target
"no family slower than before" (issue 24): writes {"bench": "regression", "family", "before_ms",
"after_ms", "before_commit", ...} and passes the benchmark's own rows of the current tree through.

    make before-tree REF=<commit>     # hccompile of <commit> under .before/ (gitignored; carry it)
    python benchmarks/before_after.py --family mhc --out benchmarks/results/host_<date>_h100.jsonl \\
        -- --layers 4 --variants n4-hc-block
    python benchmarks/before_after.py --family delta_rule --out ... \\
        -- --what kernels --impls ours --ops gdn --shapes B1T32768H16D128

The benchmark script (default per family, or --script) must take `--out FILE` and write JSON rows;
the value compared is --field of its first row. The before tree runs first: it is imported through
PYTHONPATH, ahead of an installed hccompile (with the backend="hc" entry point, torch imports
hccompile.backend by name, so the same path decides which tree runs).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from targets import run_stamp  # noqa: E402

FAMILIES = {"mhc": ("mhc.py", "step_ms"), "delta_rule": ("delta_rule.py", "fwd_bwd_ms")}


def measure(script: Path, tree: Path, args: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.jsonl"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(tree)] + [p for p in [env.get("PYTHONPATH")] if p])
        subprocess.run([sys.executable, str(script), *args, "--out", str(out)], env=env, check=True)
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", required=True, choices=sorted(FAMILIES))
    p.add_argument("--before-tree", default=str(ROOT / ".before"),
                   help="a directory holding the earlier hccompile package (default: %(default)s)")
    p.add_argument("--script", default=None, help="the benchmark (default: the family's)")
    p.add_argument("--field", default=None, help="the value compared (default: the family's)")
    p.add_argument("--out", required=True, help="append the rows here")
    a = p.parse_args(argv)
    before = Path(a.before_tree).resolve()
    if not (before / "hccompile" / "__init__.py").exists():
        p.error(f"--before-tree: {before} holds no hccompile package (make before-tree REF=<commit>)")
    script_name, field = FAMILIES[a.family]
    script = Path(a.script) if a.script else HERE / script_name
    field = a.field or field
    before_rows = measure(script, before, rest)
    after_rows = measure(script, ROOT, rest)
    if not before_rows or not after_rows:
        raise SystemExit("the benchmark wrote no rows")
    stamp = run_stamp()
    before_commit = (before / "COMMIT").read_text().strip() if (before / "COMMIT").exists() else None
    row = {**{k: after_rows[0][k] for k in ("device", "torch", "triton", "shape") if k in after_rows[0]},
           **stamp, "bench": "regression", "family": a.family, "field": field,
           "before_ms": before_rows[0][field], "after_ms": after_rows[0][field],
           "before_commit": before_commit, "variant": after_rows[0].get("variant")}
    with open(a.out, "a") as f:
        for r in after_rows:
            f.write(json.dumps({**r, **stamp}) + "\n")
        f.write(json.dumps(row) + "\n")
    print(f"{a.family}: before {row['before_ms']:.3f} ms, after {row['after_ms']:.3f} ms "
          f"({row['after_ms'] / row['before_ms']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
