"""Run the batch-size optimizer server for tests and benchmarks: a real ``joules serve`` process.

:class:`ServerProcess` starts ``joules serve`` on a free port and waits for ``/healthz``;
:func:`temporary_postgres_database` makes a uniquely named PostgreSQL database and drops it
afterwards. Only the standard library, httpx and (for PostgreSQL) psycopg are needed here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from joules.servers.batch_size.settings import DB_ENV, TOKEN_ENV
from joules.testing.processes import free_port

PG_ADMIN_URL_ENV = "JOULES_TEST_POSTGRES_URL"
DEFAULT_PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/test"


def joules_command() -> list[str]:
    """The ``joules`` entry point of the running interpreter's environment."""
    script = Path(sys.executable).with_name("joules")
    return [str(script)] if script.exists() else [sys.executable, "-m", "joules"]


class ServerProcess:
    """``joules serve`` in a child process (its own process group).

    Args:
        db_url: The database (``sqlite:///PATH`` or ``postgresql://...``; ``None``: no ``--db``).
        log_path: Where the server's output goes.
        port: Port to listen on (default: a free one).
        workers: ``--workers``.
        token: ``--token`` (``None``: no token).
        policy_factory: ``--policy-factory MODULE:NAME`` (``None``: joules' policy).
        extra_args: More options.
        env: Environment variables (``JOULES_SERVER_TOKEN`` and ``JOULES_SERVER_DB`` are not
            inherited from this process, only taken from here).
    """

    def __init__(self, db_url: str | None, log_path: str | Path, port: int | None = None, workers: int = 1,
                 token: str | None = None, policy_factory: str | None = None,
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.db_url = db_url
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.workers = workers
        self.token = token
        self.policy_factory = policy_factory
        self.extra_args = list(extra_args)
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """The authorization header, if the server has a token."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def start(self, timeout_s: float = 60.0) -> ServerProcess:
        """Start the server and wait until ``/healthz`` answers 200."""
        args = [*joules_command(), "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--workers", str(self.workers), "--log-level", "warning", *self.extra_args]
        if self.db_url is not None:
            args += ["--db", self.db_url]
        if self.token:
            args += ["--token", self.token]
        if self.policy_factory:
            args += ["--policy-factory", self.policy_factory]
        env = dict(os.environ)
        env.pop(TOKEN_ENV, None)
        env.pop(DB_ENV, None)
        env.update(self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"joules serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"joules serve did not answer within {timeout_s} s:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        """What the server printed so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server and its workers (its whole process group): a crash."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (uvicorn shuts down gracefully), then SIGKILL what is left."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # workers left behind, if any
        self.proc.wait()
        self.proc = None

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def postgres_admin_url() -> str:
    """The URL of a PostgreSQL database to create test databases from (``JOULES_TEST_POSTGRES_URL``)."""
    return os.environ.get(PG_ADMIN_URL_ENV) or DEFAULT_PG_ADMIN_URL


def postgres_available(admin_url: str | None = None) -> str | None:
    """``None`` when a PostgreSQL server answers at ``admin_url``, else why not."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install 'joules[postgres]')"
    try:
        with psycopg.connect(_libpq_url(admin_url or postgres_admin_url()), connect_timeout=3):
            return None
    except psycopg.Error as e:
        return f"no PostgreSQL server: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}"


def _libpq_url(url: str) -> str:
    """A SQLAlchemy-style URL (``postgresql+psycopg://``) as libpq wants it."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


@contextlib.contextmanager
def temporary_postgres_database(prefix: str = "joules_test", admin_url: str | None = None) -> Iterator[str]:
    """Create a uniquely named database; yield its URL (``postgresql+psycopg://``); drop it afterwards."""
    import psycopg
    from psycopg import sql

    admin = _libpq_url(admin_url or postgres_admin_url())
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    base, _, _ = admin.rpartition("/")
    try:
        yield base.replace("postgresql://", "postgresql+psycopg://", 1) + "/" + name
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
