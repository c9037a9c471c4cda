import subprocess
import sys


def test_demo_runs_and_checks_against_eager():
    r = subprocess.run([sys.executable, "-m", "hccompile", "demo", "--seq", "40", "--dim", "32",
                        "--heads", "2", "--layers", "1", "--iters", "1", "--batch", "2"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "correctness vs eager" in r.stdout and "-> OK" in r.stdout
    assert "causal_linear_attn" in r.stdout
    assert "| hc |" in r.stdout and "| inductor |" in r.stdout
    assert "gradients against no recompute (dropout on): identical -> OK" in r.stdout  # bit-identical at this size
