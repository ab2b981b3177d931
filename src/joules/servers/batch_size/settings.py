"""Settings of the batch-size optimizer server: environment variables and defaults.

Importable without FastAPI, SQLAlchemy or the other server packages, so that the command line,
the client and the test helpers share these names with the server.
"""

from __future__ import annotations

DB_ENV = "JOULES_SERVER_DB"
"""The database URL (or a plain path to a SQLite file)."""
TOKEN_ENV = "JOULES_SERVER_TOKEN"
"""The bearer token the server requires on ``/jobs`` and the client sends."""
POLICY_ENV = "JOULES_SERVER_POLICY_FACTORY"
"""``module:attribute`` of a callable that makes the policies (tests)."""
MIGRATED_ENV = "JOULES_SERVER_MIGRATED"
"""The database URL ``joules serve --workers N`` migrated before starting its workers, which then
skip the migrations when their database is this one."""
DEFAULT_DB_FILE = "batch-size.sqlite"


def default_database_url() -> str:
    """The default database: ``batch-size.sqlite`` in the joules state directory.

    Returns:
        The SQLite file's path (``joules serve`` accepts a plain path as a SQLite URL).
    """
    from joules.optimizers.power_limit.store import default_state_dir

    return str(default_state_dir() / DEFAULT_DB_FILE)
