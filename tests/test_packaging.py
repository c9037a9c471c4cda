"""The wheel: built from this tree, installed into a fresh environment, it registers backend="hc"
with no `import hccompile`, provides the `hccompile` command, and its metadata states the torch and
Triton ranges (issue 23).

The fresh environment borrows torch and the other dependencies from the environment running the
tests instead of downloading them. `python -m venv --system-site-packages` cannot do that here:
from a venv's interpreter it exposes the *base* interpreter's site-packages (pyvenv.cfg's `home`),
not the venv's, and torch lives in the venv. So the fresh venv is created without system packages
and a .pth file adds a directory of links to this environment's site-packages entries, every
hccompile entry left out (its dist-info and the editable-install finder): the only hccompile the
fresh environment can find, and the only `hc` entry point, are the wheel's.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

ROOT = pathlib.Path(__file__).parents[1]

PROBE = """
import sys
import torch

def f(x):
    return torch.sin(x) * 2

x = torch.randn(8)
out = torch.compile(f, backend="hc")(x)
assert torch.allclose(out, f(x))
import hccompile  # already imported by torch's backend lookup, through the entry point
import importlib.metadata as md
(ep,) = [e for e in md.entry_points(group="torch_dynamo_backends") if e.name == "hc"]
print("HCCOMPILE_FILE", hccompile.__file__)
print("ENTRY_POINT", ep.value, getattr(ep.dist, "_path", "?"))
"""


def _site_packages() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["purelib"])


def _build_wheel(tmp: pathlib.Path) -> pathlib.Path:
    """pip wheel of a copy of the sources (building in place would write build/ into the tree);
    --no-build-isolation uses this environment's setuptools instead of downloading one."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "hccompile", src / "hccompile", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(dist), str(src)], check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = dist.glob("hccompile-*.whl")
    return wheel


def _fresh_venv(tmp: pathlib.Path) -> pathlib.Path:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    target = pathlib.Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                          "['purelib'])"], check=True, capture_output=True, text=True,
                                         timeout=60).stdout.strip())
    deps = tmp / "deps"
    deps.mkdir()
    for entry in _site_packages().iterdir():
        name = entry.name.lower()
        if name.startswith(("hccompile", "__editable__", "_hccompile")) or name.endswith(".pth"):
            continue
        (deps / entry.name).symlink_to(entry)
    (target / "borrowed_dependencies.pth").write_text(f"{deps}\n")
    return python


def test_wheel_registers_backend_without_import(tmp_path):
    wheel = _build_wheel(tmp_path)

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    requires = {line.split(":", 1)[1].strip().split(";")[0].replace(" ", "")
                for line in meta.splitlines() if line.startswith("Requires-Dist:")}
    assert {"torch<2.16,>=2.11", "triton<3.10,>=3.6"} <= requires, requires
    assert "[torch_dynamo_backends]\nhc = hccompile.backend:hc_backend" in entry_points
    assert "hccompile = hccompile.cli:main" in entry_points
    assert "hccompile/kernels/delta_rule/chunk.py" in names and "hccompile/cli.py" in names

    python = _fresh_venv(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "-q", str(wheel)], check=True, capture_output=True, text=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.pop("TRITON_INTERPRET", None)  # the probe needs no kernels: the reference paths are enough
    work = tmp_path / "work"  # not the source tree: `import hccompile` must find the installed copy
    work.mkdir()
    r = subprocess.run([str(python), "-c", PROBE], cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    installed = str(tmp_path / "venv")
    file_line = next(line for line in r.stdout.splitlines() if line.startswith("HCCOMPILE_FILE"))
    assert file_line.split(" ", 1)[1].startswith(installed), file_line
    entry_line = next(line for line in r.stdout.splitlines() if line.startswith("ENTRY_POINT"))
    assert entry_line.split(" ")[1] == "hccompile.backend:hc_backend" and installed in entry_line, entry_line

    r = subprocess.run([str(tmp_path / "venv" / "bin" / "hccompile"), "--version"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("hccompile 0.1.0"), r.stderr[-2000:]
