"""``joules serve``: the batch-size optimizer server (needs ``pip install 'joules[server]'``).

FastAPI, uvicorn and SQLAlchemy are imported only when the command runs, so that the rest of
the command line does not pay for them (or need them installed).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile

import typer

from joules.errors import JoulesError
from joules.servers.batch_size.settings import (
    DB_ENV,
    MIGRATED_ENV,
    POLICY_ENV,
    TOKEN_ENV,
    default_database_url,
)

SERVER_EXTRA_HINT = "pip install 'joules[server]'"


def _check_server_packages() -> None:
    missing = []
    for module in ("fastapi", "uvicorn", "sqlalchemy", "alembic", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise JoulesError(f"joules serve needs {', '.join(missing)}: {SERVER_EXTRA_HINT}")


def _check_port(host: str, port: int) -> None:
    """Fail with one line now rather than after the database is set up (uvicorn binds later)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise JoulesError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise JoulesError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e


def prepare_database(database_url: str) -> str:
    """Check the URL, connect, and migrate; return the normalized URL (password included).

    Raises:
        JoulesError: Bad URL, missing driver, or the database cannot be reached or migrated.
    """
    from sqlalchemy.exc import DBAPIError, SQLAlchemyError

    from joules.servers.batch_size import db as dbm

    url = dbm.normalize_url(database_url)
    database = dbm.Database(url)
    try:
        dbm.upgrade(database)
    except DBAPIError as e:
        first = str(e.orig).strip().splitlines()[0] if e.orig is not None and str(e.orig).strip() else str(e)
        raise JoulesError(f"cannot use database {dbm.safe_url(url)}: {first}") from e
    except SQLAlchemyError as e:
        raise JoulesError(f"cannot use database {dbm.safe_url(url)}: {str(e).splitlines()[0]}") from e
    finally:
        database.dispose()
    return url.render_as_string(hide_password=False)


def start_line(url: str, host: str, port: int) -> str:
    """The line ``joules serve`` prints on start-up: where it listens and its database (password hidden)."""
    from joules.servers.batch_size import db as dbm

    address = f"[{host}]" if ":" in host else host  # an IPv6 address
    return f"joules serve: listening on http://{address}:{port}, database {dbm.safe_url(url)}"


def register(app: typer.Typer) -> None:
    """Add the command to the app."""

    @app.command()
    def serve(
        db: str | None = typer.Option(
            None, "--db", metavar="URL", envvar=DB_ENV,
            help="sqlite:///PATH or postgresql://USER@HOST:PORT/DATABASE (a plain path is a SQLite file). "
                 "Default: batch-size.sqlite in the joules state directory.",
        ),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
        port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port to listen on."),
        workers: int = typer.Option(
            1, "--workers", min=1, max=256,
            help="Server processes (they share the database; any number is correct)."),
        token: str | None = typer.Option(
            None, "--token", metavar="TOKEN", envvar=TOKEN_ENV,
            help=f"Require 'Authorization: Bearer TOKEN' on /jobs (also: {TOKEN_ENV})."),
        log_level: str = typer.Option(
            "info", "--log-level", help="uvicorn's log level: critical, error, warning, info, debug, trace."),
        policy_factory: str | None = typer.Option(
            None, "--policy-factory", metavar="MODULE:NAME", hidden=True,
            help="Make policies with this callable instead of joules' own (tests)."),
    ) -> int:
        """Run the batch-size optimizer server (HTTP API; see docs/batch-size-server.md).

        Applies the database's migrations first. With --workers N, N processes share the
        database: every change locks the job's row, so they stay consistent.
        """
        _check_server_packages()
        from joules.servers.batch_size import app as appm
        from joules.servers.batch_size.schemas import token_problem

        if log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise JoulesError(f"bad --log-level {log_level!r}: "
                              "critical, error, warning, info, debug or trace")
        if token is None and os.environ.get(TOKEN_ENV) == "":
            token = ""  # (click takes an empty variable for unset: a secret that failed to load)
        if token is not None and (problem := token_problem(token)) is not None:
            raise JoulesError(f"--token (or ${TOKEN_ENV}) {problem}: fix it, or leave the option out")
        if db is None:
            db = default_database_url()
        factory = appm.load_policy_factory(policy_factory)  # fails early on a bad MODULE:NAME
        _check_port(host, port)
        url = prepare_database(db)
        print(start_line(url, host, port), file=sys.stderr, flush=True)  # whatever --log-level says
        return _run(url, host, port, workers, token, log_level.lower(), policy_factory, factory)


def _run(url: str, host: str, port: int, workers: int, token: str | None, log_level: str,
         policy_factory: str | None, factory: object) -> int:
    import uvicorn

    from joules.servers.batch_size import app as appm
    from joules.servers.batch_size.protocol import HTTP_PROTOCOL

    if workers == 1:
        app = appm.create_app(url, token=token, policy_factory=factory, migrate=False)  # type: ignore[arg-type]
        uvicorn.run(app, host=host, port=port, log_level=log_level, http=HTTP_PROTOCOL)
        return 0
    # The workers are fresh processes: they get their settings from the environment. The
    # database was migrated above, so they skip that.
    os.environ[DB_ENV] = url
    os.environ[MIGRATED_ENV] = url
    for name, value in ((TOKEN_ENV, token), (POLICY_ENV, policy_factory)):
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    metrics_dir = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        metrics_dir = tempfile.mkdtemp(prefix="joules-serve-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        uvicorn.run("joules.servers.batch_size.app:app_from_env", factory=True, host=host, port=port,
                    workers=workers, log_level=log_level, http=HTTP_PROTOCOL)
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0
