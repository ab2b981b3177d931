"""Shared test setup."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path_factory, monkeypatch):
    """Journals and saved profiles go to a temporary directory, never the user's own."""
    monkeypatch.setenv("JOULES_STATE_DIR", str(tmp_path_factory.mktemp("joules-state")))
