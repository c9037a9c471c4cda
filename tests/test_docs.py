"""The examples in README.md, docs/options.md and examples/ run as written."""
import pathlib
import re
import runpy

import pytest

ROOT = pathlib.Path(__file__).parents[1]


def _blocks(path):
    return re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(), flags=re.S)


@pytest.mark.parametrize("path", ["README.md", "docs/options.md", "docs/dumps.md", "docs/mhc.md", "docs/cp.md",
                                  "docs/lightning.md",
                                  "docs/delta_rule.md", "docs/htree.md"])
def test_markdown_python_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks(path)
    assert blocks
    for i, code in enumerate(blocks):
        # run as a script (not exec in a dict): Dynamo imports the defining module of functions
        script = tmp_path / f"block_{i}.py"
        script.write_text(code)
        runpy.run_path(str(script), run_name="__main__")


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_example_scripts_run(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")


def test_options_pass_table_lists_every_pass():
    """docs/options.md's pass table names every registered pass, with its stage."""
    from hccompile.passes import passes_for_stage

    text = (ROOT / "docs/options.md").read_text()
    table = text[text.index("## Passes"):text.index("## What happens when a pass fails")]
    rows = dict(re.findall(r"^\| `(\w+)` \| (\w+) \|", table, flags=re.M))
    registered = {p.name: stage for stage in ("dynamo", "joint", "post_grad") for p in passes_for_stage(stage)}
    assert rows == registered
