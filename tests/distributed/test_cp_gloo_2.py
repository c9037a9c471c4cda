"""Context parallelism over 2 real processes (torch.distributed, gloo on CPU, kernels in Triton's
interpreter): outputs, final states and every gradient of the public functions under
context_parallel equal the single-process run (tests/distributed/cp_worker.py has the cases: layouts,
strategies, sequences crossing 0, 1 and several rank boundaries, uneven splits, fixed-length rows,
initial state, KDA's in-kernel gate, a model compiled with backend="hc", and the GDN written in
plain PyTorch, lowered by the delta-rule pass or traced as the op by hc's substitutes, and run as CP with
no model edits)."""
from __future__ import annotations

import pytest
import torch

from cp_worker import SUITES
from harness import assert_matches_single_process, run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(2, "two", tmp_path_factory.mktemp("cp2") / "results.json", timeout=600)


@pytest.mark.parametrize("name", SUITES["two"])
def test_matches_single_process(results, name):
    assert_matches_single_process(name, results[name])
