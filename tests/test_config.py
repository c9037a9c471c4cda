import pathlib

import pytest
import torch

from hccompile.config import OPTIONS, OptionError, options_table_markdown, resolve


def test_defaults():
    cfg = resolve(None, environ={})
    assert cfg.dump_dir is None and cfg.strict is False and cfg.probe is True
    assert cfg.inductor_patches == {}


def test_unknown_option_lists_valid_ones():
    with pytest.raises(OptionError) as e:
        resolve({"dump_dri": "x"}, environ={})
    msg = str(e.value)
    assert "dump_dri" in msg and "dump_dir" in msg and "torch._inductor.config" in msg


def test_bad_type_names_option_and_type():
    with pytest.raises(OptionError, match="'strict'.*expected bool"):
        resolve({"strict": "yes"}, environ={})
    with pytest.raises(OptionError, match="unknown pass name"):
        resolve({"disable_passes": ["no_such_pass"]}, environ={})
    with pytest.raises(OptionError, match="probe_tolerance"):
        resolve({"probe_tolerance": 3.0}, environ={})
    with pytest.raises(OptionError, match="compiler"):
        resolve({"compiler": "tvm"}, environ={})


def test_inductor_options_and_mode_pass_through():
    cfg = resolve({"epilogue_fusion": False, "strict": True}, mode="max-autotune-no-cudagraphs",
                  environ={})
    assert cfg.strict is True
    assert cfg.inductor_patches["epilogue_fusion"] is False
    assert cfg.inductor_patches["max_autotune"] is True
    with pytest.raises(OptionError, match="mode='fastest'"):
        resolve(None, mode="fastest", environ={})


def test_env_spellings_and_precedence():
    env = {"HCCOMPILE_DUMP": "/tmp/d", "HCCOMPILE_STRICT": "1", "HCCOMPILE_DISABLE_PASSES": "linear_attn",
           "HCCOMPILE_PROBE": "false"}
    cfg = resolve(None, environ=env)
    assert cfg.dump_dir == "/tmp/d" and cfg.strict and not cfg.probe
    assert cfg.disable_passes == ("linear_attn",)
    assert resolve({"strict": False}, environ=env).strict is False  # options= wins
    with pytest.raises(OptionError, match="HCCOMPILE_STRICT"):
        resolve(None, environ={"HCCOMPILE_STRICT": "maybe"})


def test_backend_rejects_bad_option_clearly():
    with pytest.raises(Exception, match="unknown option 'nope'"):
        torch.compile(lambda x: x + 1, backend="hc", options={"nope": 1})(torch.ones(2))


def test_docs_options_table_in_sync():
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "options.md").read_text()
    assert options_table_markdown() in doc, "regenerate the table in docs/options.md"
    for name in OPTIONS:
        assert f"`{name}`" in doc
