"""Fixtures of the batch-size server tests: real ``joules serve`` processes on SQLite and PostgreSQL.

PostgreSQL tests use a fresh, uniquely named database per test session (dropped afterwards)
on the server at ``JOULES_TEST_POSTGRES_URL`` (default
``postgresql://postgres@127.0.0.1:5432/test``); they are skipped when none answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

for _module in ("fastapi", "uvicorn", "sqlalchemy", "alembic", "prometheus_client"):
    pytest.importorskip(_module)

from bso_helpers import TEST_POLICY, TOKEN, Served  # noqa: E402

from joules.testing.bso_server import (  # noqa: E402
    ServerProcess,
    postgres_available,
    temporary_postgres_database,
)

BACKENDS = ["sqlite", "postgresql"]


@pytest.fixture(scope="session")
def bso_pg_problem() -> str | None:
    return postgres_available()


@pytest.fixture(scope="session")
def bso_databases(tmp_path_factory: pytest.TempPathFactory,
                  bso_pg_problem: str | None) -> Iterator[Callable[[str], str]]:
    """``new(backend)`` -> the URL of a new, empty database (SQLite file or PostgreSQL database)."""
    stack = ExitStack()
    base = tmp_path_factory.mktemp("bso-db")
    count = [0]

    def new(backend: str) -> str:
        count[0] += 1
        if backend == "sqlite":
            return f"sqlite:///{base / f'db{count[0]}.sqlite'}"
        if bso_pg_problem is not None:
            pytest.skip(bso_pg_problem)
        return stack.enter_context(temporary_postgres_database("joules_bso_test"))

    with stack:
        yield new


@pytest.fixture(scope="session")
def bso_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bso-logs")


@pytest.fixture(scope="session", params=BACKENDS)
def bso_server(request: pytest.FixtureRequest, bso_databases: Callable[[str], str],
               bso_logs: Path) -> Iterator[Served]:
    """A server with two worker processes and a token, shared by the session's tests on one backend."""
    backend = request.param
    db_url = bso_databases(backend)
    server = ServerProcess(db_url, bso_logs / f"shared-{backend}.log", workers=2, token=TOKEN,
                           policy_factory=TEST_POLICY)
    served = Served(backend, db_url, server.start())
    yield served
    served.close()
    server.stop()


@pytest.fixture(params=BACKENDS)
def bso_backend(request: pytest.FixtureRequest) -> str:
    return request.param
