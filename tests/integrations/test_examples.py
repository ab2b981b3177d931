"""The examples run as documented on simulated GPUs, and the integrations import only what they need."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_power_limit_pytorch_example(tmp_path):
    pytest.importorskip("torch")
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / "power_limit_pytorch.py"), "--sim", "A100", "--epochs", "4",
         "--steps", "25", "--warmup-steps", "2", "--profile-steps", "5"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "JOULES_STATE_DIR": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert re.search(r"^epoch 4/4: .*optimizer done, limit 225\.0 W$", out, re.M), out
    assert "chosen power limit: 225 W (energy)" in out
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)(  <- chosen)?$", out, re.M)
    assert len(rows) >= 3
    assert [float(r[0]) for r in rows if r[3]] == [225.0]
    energy = {float(limit): float(e) for limit, _, e, _ in rows}
    assert min(energy, key=energy.get) == 225.0
    assert "power limits before: [400.0] W, after training: [400.0] W" in out


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_the_integrations_package_imports_no_framework():
    r = python("import sys, joules.integrations; "
               "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning', 'torch') "
               "if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize(("module", "blocked", "extra"), [
    ("huggingface", ["transformers"], "joules[huggingface]"),
    ("lightning", ["lightning", "pytorch_lightning"], "joules[lightning]"),
])
def test_a_missing_framework_names_the_extra_to_install(module, blocked, extra):
    block = "; ".join(f"sys.modules[{m!r}] = None" for m in blocked)  # makes `import m` fail
    r = python(f"import sys; {block}; import joules.integrations.{module}")
    assert r.returncode == 1
    assert f"ImportError: joules.integrations.{module} needs" in r.stderr
    assert f"pip install '{extra}'" in r.stderr
