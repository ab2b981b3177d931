"""Every example in the README runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BIN = Path(sys.executable).parent


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("JOULES_SIM", None)
    return env


@pytest.mark.parametrize("code", _blocks("python"), ids=lambda c: c.splitlines()[0][:40])
@pytest.mark.parametrize("sim", [None, "A100x2"])
def test_python_examples_run(code: str, sim: str | None, tmp_path: Path) -> None:
    env = _env()
    if sim:
        env["JOULES_SIM"] = sim
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _commands() -> list[str]:
    cmds = []
    for block in _blocks("console"):
        for line in block.splitlines():
            if line.startswith("$ ") and "tasks.py" not in line:
                cmds.append(line[2:])
    return cmds


def test_readme_has_examples() -> None:
    assert len(_blocks("python")) >= 3
    assert len(_commands()) >= 6


@pytest.mark.parametrize("cmd", _commands())
def test_shell_examples_run(cmd: str, tmp_path: Path) -> None:
    r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
