#!/usr/bin/env python3
"""Project tasks, with nothing but Python 3.11+ needed to start.

    python3 tasks.py demo    # make .venv, install joules, run `joules demo`
    python3 tasks.py test    # make .venv, install CPU torch and joules[test], run ruff and pytest

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
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Extras whose packages depend on torch (transformers, lightning, ...): pip would pull the CUDA
# build of torch for them, so they are installed only once a torch is there, and pinned to it.
TORCH_EXTRAS = ("huggingface", "lightning")


def run(*cmd: str | Path, check: bool = True) -> int:
    """Run a command from the repository root, echoing it."""
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, check=check).returncode


def make_venv() -> None:
    """Create .venv if needed."""
    if sys.version_info < (3, 11):  # noqa: UP036 - tasks.py may be run by an older python3
        sys.exit(f"joules needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    if not PY.exists():
        run(sys.executable, "-m", "venv", VENV)


def installed_torch() -> str | None:
    """The version of torch installed in .venv, or ``None``."""
    r = subprocess.run([str(PY), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                       cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def torch_free_requirements(extras: str) -> list[str]:
    """The requirements of ``extras`` (comma-separated) less those of the torch-dependent extras."""
    import tomllib

    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    needs_torch = {r for name in TORCH_EXTRAS for r in optional.get(name, [])}
    names = [e.strip() for e in extras.split(",") if e.strip()]
    return [r for e in names if e not in TORCH_EXTRAS for r in optional.get(e, []) if r not in needs_torch]


def ensure_venv(extras: str = "") -> None:
    """Create .venv if needed and install joules (editable) with the given extras.

    When torch is installed, it is pinned (a pip constraint), so that no extra replaces it with
    the CUDA build. When it is not, the packages that depend on it are left out (their tests
    are skipped) rather than pulling the CUDA build in.
    """
    make_venv()
    pip = [PY, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    torch = installed_torch()
    if torch is not None or not extras:
        spec = f".[{extras}]" if extras else "."
        constraint: list[str | Path] = []
        if torch is not None:
            pin = VENV / "torch-constraint.txt"
            pin.write_text(f"torch=={torch}\n")
            constraint = ["-c", pin]
        run(*pip, *constraint, "-e", spec)
        return
    print("note: torch is not installed; the integration tests' packages are left out (those tests skip)")
    run(*pip, "-e", ".", *torch_free_requirements(extras))


def ensure_torch() -> None:
    """Install the CPU build of torch (before anything that depends on torch), if it can be had."""
    make_venv()
    if installed_torch() is not None:
        return
    pip = [PY, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", TORCH]
    if run(*pip, check=False) == 0 or run(*pip, "--extra-index-url", TORCH_CPU_INDEX, check=False) == 0:
        return
    print(f"note: {TORCH} is not available here; torch.distributed and integration tests will be skipped")


def demo(args: list[str]) -> int:
    """Run the simulated training demo."""
    ensure_venv()
    return run(BIN / "joules", "demo", *args, check=False)


def test(args: list[str]) -> int:
    """Lint and run the test suite."""
    ensure_torch()  # first: the test extra's transformers and lightning need a torch
    ensure_venv("test")
    lint = [p for p in ("src", "tests", "benchmarks", "examples", "tasks.py") if (ROOT / p).exists()]
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
