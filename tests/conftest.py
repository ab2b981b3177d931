"""Shared test setup."""

from __future__ import annotations

import signal

import pytest

# A shell without job control starts background commands with SIGINT ignored, and children
# inherit that, so the tests that press Ctrl-C on a child would fail when pytest runs as
# `... &`. Handling it here gives every child started from now on the default action.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path_factory, monkeypatch):
    """Journals and saved profiles go to a temporary directory, never the user's own."""
    monkeypatch.setenv("JOULES_STATE_DIR", str(tmp_path_factory.mktemp("joules-state")))
