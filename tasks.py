#!/usr/bin/env python3
"""Project tasks, with nothing but Python 3.11+ needed to start.

    python3 tasks.py demo    # make .venv, install joules, run `joules demo`
    python3 tasks.py test    # make .venv, install joules[test] (+ CPU torch), run ruff and pytest

Extra arguments after the task go to the command (e.g. ``python3 tasks.py test -k monitor``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
# The CPU build only: the plain PyPI wheel pulls several GB of CUDA packages.
TORCH = "torch==2.13.0+cpu"


def run(*cmd: str | Path, check: bool = True) -> int:
    """Run a command from the repository root, echoing it."""
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, check=check).returncode


def ensure_venv(extras: str = "") -> None:
    """Create .venv if needed and install joules (editable) with the given extras."""
    if sys.version_info < (3, 11):  # noqa: UP036 - tasks.py may be run by an older python3
        sys.exit(f"joules needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    if not PY.exists():
        run(sys.executable, "-m", "venv", VENV)
    spec = f".[{extras}]" if extras else "."
    run(PY, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-e", spec)


def ensure_torch() -> None:
    """Install the CPU build of torch for the multi-process tests, if it can be had."""
    if run(PY, "-c", "import torch", check=False) == 0:
        return
    if run(PY, "-m", "pip", "install", "--quiet", TORCH, check=False) != 0:
        print(f"note: {TORCH} is not available here; torch.distributed tests will be skipped")


def demo(args: list[str]) -> int:
    """Run the simulated training demo."""
    ensure_venv()
    return run(BIN / "joules", "demo", *args, check=False)


def test(args: list[str]) -> int:
    """Lint and run the test suite."""
    ensure_venv("test")
    ensure_torch()
    lint = [p for p in ("src", "tests", "benchmarks", "tasks.py") if (ROOT / p).exists()]
    if run(BIN / "ruff", "check", *lint, check=False) != 0:
        return 1
    return run(PY, "-m", "pytest", *args, check=False)


TASKS = {"demo": demo, "test": test}


def main() -> int:
    """Dispatch ``python3 tasks.py TASK [ARGS...]``."""
    if len(sys.argv) < 2 or sys.argv[1] not in TASKS:
        print(__doc__)
        return 2
    return TASKS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
