"""Shared test setup."""

from __future__ import annotations

import importlib.util
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# A shell without job control starts background commands with SIGINT ignored, and children
# inherit that, so the tests that press Ctrl-C on a child would fail when pytest runs as
# `... &`. Handling it here gives every child started from now on the default action.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path_factory, monkeypatch):
    """Journals and saved profiles go to a temporary directory, never the user's own; and
    each test starts without simulated hardware in the environment (a CLI run in-process with
    ``--sim`` puts it there for its child processes), which is removed again after it."""
    monkeypatch.setenv("JOULES_STATE_DIR", str(tmp_path_factory.mktemp("joules-state")))
    monkeypatch.delenv("JOULES_SIM", raising=False)
    monkeypatch.delenv("JOULES_SIM_STATE", raising=False)


@pytest.fixture(scope="module")
def load_benchmark() -> Iterator[Callable[[str], ModuleType]]:
    """Import ``benchmarks/NAME.py`` as the module ``NAME`` (removed again after the test module)."""
    loaded: list[str] = []

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        loaded.append(name)
        sys.path.insert(0, str(BENCHMARKS))  # as when run: its helpers (_timing, ...) import
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(BENCHMARKS))
        return module

    yield load
    for name in loaded:
        sys.modules.pop(name, None)
