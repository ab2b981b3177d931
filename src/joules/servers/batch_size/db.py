"""The server's database: tables, engines for SQLite and PostgreSQL, transactions, migrations.

Three tables (prefixed ``bso_`` so that they can share a database with other applications):

- ``bso_jobs``: one row per recurring job: its spec (the :class:`JobCreate` it was registered
  with), the policy's state (JSON text) and a version number bumped on every change.
- ``bso_trials``: one row per trial: batch size, phase, stop cost, status, outcome, totals,
  last activity (for expiry).
- ``bso_epoch_reports``: one row per (trial, epoch) with the answer given, so a retried report
  gets the same answer without being counted twice.

Every change happens in one transaction that first locks the job's row (see
:meth:`Database.transaction` and :func:`lock_job`): ``SELECT ... FOR UPDATE`` on PostgreSQL,
``BEGIN IMMEDIATE`` (the database's write lock) on SQLite. No lock lives in a process, so any
number of server processes can share the database.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Double,
    Engine,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    select,
    text,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from joules.errors import JoulesError
from joules.filelock import exclusive

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "bso_alembic_version"
# Key of the PostgreSQL advisory lock held while migrating (any fixed 64-bit number).
_ADVISORY_LOCK_KEY = 0x6A6F756C6573  # "joules"
SQLITE_BUSY_TIMEOUT_S = 60.0
# Server default of bso_trials.last_activity_at (the service always sets it; migration 0002
# fills existing rows from their reports).
EPOCH_START = "'1970-01-01 00:00:00'"


def utcnow() -> datetime:
    """Now, in UTC (timezone-aware)."""
    return datetime.now(UTC)


def as_utc(value: datetime | None) -> datetime | None:
    """``value`` as an aware UTC datetime (SQLite gives back naive ones)."""
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    """Base of the server's models (constraints get fixed names, the same on every database)."""

    metadata = MetaData(naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    })


class Job(Base):
    """A recurring job and its policy's state."""

    __tablename__ = "bso_jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    policy: Mapped[str] = mapped_column(String(32))
    policy_state: Mapped[str] = mapped_column(Text, doc="The policy's state, as JSON text.")
    stop_cost: Mapped[float | None] = mapped_column(
        Double, nullable=True, doc="The policy's stop cost in that state (kept: reports need not load it).")
    version: Mapped[int] = mapped_column(Integer)
    trials_started: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    # Optimistic check on top of the row lock: an UPDATE that finds another version fails.
    __mapper_args__ = {"version_id_col": version}


class Trial(Base):
    """One recurrence of a job, trained with one batch size."""

    __tablename__ = "bso_trials"
    __table_args__ = (UniqueConstraint("job_id", "seq"), UniqueConstraint("job_id", "request_id"))

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("bso_jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer, doc="1, 2, ... within the job: the order of creation.")
    batch_size: Mapped[int] = mapped_column(Integer)
    phase: Mapped[str] = mapped_column(String(16))
    stop_cost: Mapped[float | None] = mapped_column(Double, nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    outcome: Mapped[str | None] = mapped_column(String(16), nullable=True)
    epochs: Mapped[int] = mapped_column(Integer, default=0)
    time_s: Mapped[float] = mapped_column(Double, default=0.0)
    energy_j: Mapped[float] = mapped_column(Double, default=0.0)
    cost: Mapped[float] = mapped_column(Double, default=0.0)
    client: Mapped[str | None] = mapped_column(String(200), nullable=True)
    request_id: Mapped[str | None] = mapped_column(String(64), nullable=True,
                                                   doc="The client's idempotency key.")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_activity_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=text(EPOCH_START),
        doc="Creation or latest epoch report: a running trial idle for the job's stale_after_s is expired.")


class EpochReportRow(Base):
    """One epoch of a trial and the answer the server gave to it."""

    __tablename__ = "bso_epoch_reports"
    __table_args__ = (UniqueConstraint("trial_id", "epoch"),)

    # 64-bit on PostgreSQL (one sequence serves every job); SQLite's rowid is 64-bit already,
    # and only INTEGER is its rowid alias.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    trial_id: Mapped[str] = mapped_column(ForeignKey("bso_trials.id", ondelete="CASCADE"))
    epoch: Mapped[int] = mapped_column(Integer)
    time_s: Mapped[float] = mapped_column(Double)
    energy_j: Mapped[float] = mapped_column(Double)
    metric: Mapped[float] = mapped_column(Double)
    stop: Mapped[bool] = mapped_column(Boolean)
    reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    cost: Mapped[float] = mapped_column(Double)
    stop_cost: Mapped[float | None] = mapped_column(Double, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


def normalize_url(database_url: str) -> URL:
    """Parse a database URL (or a plain file path, taken as SQLite) and pick the drivers joules uses.

    ``postgresql://`` and ``postgres://`` use psycopg 3; ``sqlite:///path`` uses the standard
    library. In-memory SQLite is refused: every server process needs the same database.

    Raises:
        JoulesError: The URL cannot be parsed, names another database, or is in-memory SQLite.
    """
    raw = database_url.strip()
    if "://" not in raw:
        if not raw:
            raise JoulesError("empty database URL")
        if ":" in raw and not re.match(r"^[A-Za-z]:[\\/]", raw):  # a Windows drive is a path, "x:y" a typo
            raise JoulesError(f"bad database URL {_hide_password(database_url)!r}: expected "
                              "sqlite:///PATH, postgresql://USER@HOST:PORT/DATABASE or a file path")
        # The file of that name: built, not parsed (a "%41" or "?" in it is not URL syntax).
        url = URL.create("sqlite", database=str(Path(raw).expanduser().resolve()))
    else:
        if raw.startswith("postgres://"):
            raw = "postgresql://" + raw[len("postgres://"):]
        try:
            url = make_url(raw)
        except (ArgumentError, ValueError) as e:  # (ValueError: a port that is not a number)
            raise JoulesError(f"bad database URL {_hide_password(database_url)!r}: expected "
                              "sqlite:///PATH or postgresql://USER@HOST:PORT/DATABASE") from e
    backend = url.get_backend_name()
    if backend == "postgresql":
        if "+" not in url.drivername:  # no driver named: psycopg 3 (SQLAlchemy 2.0's default is psycopg2)
            url = url.set(drivername="postgresql+psycopg")
        if url.get_driver_name() != "psycopg":
            raise JoulesError(f"unsupported PostgreSQL driver {url.get_driver_name()!r}: use postgresql://...")
        if not url.database:
            raise JoulesError(f"database URL {safe_url(url)} names no database")
    elif backend == "sqlite":
        if url.get_driver_name() not in ("pysqlite", ""):
            raise JoulesError(f"unsupported SQLite driver {url.get_driver_name()!r}: use sqlite:///PATH")
        if not url.database or url.database == ":memory:" or url.query.get("mode") == "memory":
            raise JoulesError("in-memory SQLite cannot be shared by server processes: use sqlite:///PATH")
        if url.database.startswith("file:"):
            # A URI filename: "file::memory:" would be in-memory again, and its path is not
            # the name of the file (the migration lock sits beside that).
            raise JoulesError(f"SQLite URI filenames ({url.database!r}) are not supported by the "
                              "server: use sqlite:///PATH")
        # One file whatever the directory a server (or a worker) starts in; ~ is the home.
        url = url.set(database=str(Path(url.database).expanduser().resolve()))
    else:
        raise JoulesError(f"unsupported database {backend!r} in {safe_url(url)}: use sqlite:///PATH "
                          "or postgresql://USER@HOST:PORT/DATABASE")
    return url


_SECRET_QUERY_KEYS = ("password", "sslpassword")


def safe_url(url: URL | str) -> str:
    """The URL with its password hidden (also one given as a query parameter)."""
    if isinstance(url, str):
        try:
            url = make_url(url)
        except (ArgumentError, ValueError):
            return "<unparsable URL>"
    return _hide_password(url.render_as_string(hide_password=True))


def _hide_password(text: str) -> str:
    """A URL that does not parse, with whatever looks like a password in it hidden."""
    text = re.sub(r"(^|://)([^:/@]*:)[^@/]*@", r"\1\2***@", text)
    keys = "|".join(_SECRET_QUERY_KEYS)
    return re.sub(rf"([?&](?:{keys})=)[^&]*", r"\1***", text)


def _sqlite_setup(engine: Engine) -> None:
    """WAL, busy timeout, foreign keys, and transactions that begin as asked (IMMEDIATE for writes).

    The standard library's sqlite3 module begins transactions by itself, too late for a lock
    to be taken before the first read. It is put in autocommit mode and the ``BEGIN`` is
    issued here instead.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")  # durable across process crashes in WAL mode
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get("joules_write", True)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def make_engine(database_url: str | URL, pool_size: int | None = None) -> Engine:
    """An engine for ``database_url`` (see :func:`normalize_url`), set up for the server.

    Args:
        database_url: The database.
        pool_size: Connections kept per process (and twice as many more when busy). Default:
            4 on PostgreSQL; 1 on SQLite, with no more when busy: SQLite has one writer at a
            time, and requests waiting for the pool's one connection are served in turn, where
            connections waiting for SQLite's lock would poll it with growing sleeps (a long
            tail of latencies). Other processes still wait on the lock itself. The server runs
            as many requests at once as the pool keeps connections
            (:attr:`Database.concurrency`).

    Raises:
        JoulesError: Bad URL, or the database's driver is not installed.
    """
    url = database_url if isinstance(database_url, URL) else normalize_url(database_url)
    try:
        if url.get_backend_name() == "sqlite":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
            size = pool_size or 1
            engine = create_engine(
                url, pool_size=size, max_overflow=0 if pool_size is None else 2 * size, pool_timeout=120,
                connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False})
            _sqlite_setup(engine)
        else:
            size = pool_size or 4
            engine = create_engine(url, pool_size=size, max_overflow=2 * size, pool_pre_ping=True,
                                   pool_timeout=120, connect_args={"connect_timeout": 10})
    except (ModuleNotFoundError, NoSuchModuleError) as e:
        extra = "postgres" if url.get_backend_name() == "postgresql" else "server"
        raise JoulesError(f"no driver for {safe_url(url)} ({e}): pip install 'joules[{extra}]'") from e
    return engine


class Database:
    """An engine and the transactions the service runs in.

    Args:
        database_url: ``sqlite:///PATH`` or ``postgresql://...`` (see :func:`normalize_url`).
        pool_size: Connections kept open per process (see :func:`make_engine`).
    """

    def __init__(self, database_url: str | URL, pool_size: int | None = None) -> None:
        self.url = database_url if isinstance(database_url, URL) else normalize_url(database_url)
        self.engine = make_engine(self.url, pool_size=pool_size)
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        # How many transactions the process should run at once: the connections its pool keeps.
        self.concurrency: int = self.engine.pool.size()  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def transaction(self, write: bool = True) -> Iterator[Session]:
        """A session in one transaction: committed when the block ends, rolled back if it raises.

        On SQLite a writing transaction starts with ``BEGIN IMMEDIATE``, which takes the
        database's write lock (waiting up to the busy timeout for it); on PostgreSQL, writers
        lock the job's row with :func:`lock_job`. Reads (``write=False``) take no lock and see
        one snapshot (SQLite's read transaction; ``REPEATABLE READ`` on PostgreSQL).
        """
        options: dict[str, Any] = {"joules_write": write}
        if not write and not self.is_sqlite:
            options["isolation_level"] = "REPEATABLE READ"
        with Session(self.engine, expire_on_commit=False, autoflush=True) as session:
            session.connection(execution_options=options)
            try:
                yield session
                if write:
                    session.commit()
                # A read ends when the session closes (its objects stay loaded, detached).
            except BaseException:
                session.rollback()
                raise

    def ping(self) -> None:
        """Run ``SELECT 1``.

        Raises:
            sqlalchemy.exc.OperationalError: The database cannot be reached.
        """
        with self.transaction(write=False) as session:
            session.execute(text("SELECT 1"))

    def dispose(self) -> None:
        """Close the pool's connections."""
        self.engine.dispose()


def lock_job(session: Session, job_id: str) -> Job | None:
    """The job, its row locked until the transaction ends (``FOR UPDATE``; SQLite: already locked).

    Its columns are read anew even when the session read the job before the lock.
    """
    return session.execute(select(Job).where(Job.id == job_id).with_for_update()
                           .execution_options(populate_existing=True)).scalar_one_or_none()


def alembic_config(connection: Any = None) -> Any:
    """An Alembic ``Config`` for the bundled migrations (no ``alembic.ini`` needed).

    Args:
        connection: A SQLAlchemy connection the migrations run on (``env.py`` uses it).
    """
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("version_table", VERSION_TABLE)
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@contextlib.contextmanager
def _sqlite_file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created), held by this process across the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Without flock (Windows), BEGIN IMMEDIATE below still serializes the upgrade.
    with open(path, "a+b") as f, exclusive(f):
        yield


def upgrade(db: Database, revision: str = "head") -> None:
    """Apply the bundled migrations up to ``revision``; safe when several processes start at once.

    On PostgreSQL the upgrade runs in one transaction that first takes an advisory lock, so a
    second process waits, then finds the schema up to date. On SQLite a file lock next to the
    database does the same (and the upgrade runs inside ``BEGIN IMMEDIATE``).
    """
    from alembic import command
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    def run() -> None:
        with db.engine.connect() as conn:
            conn.execution_options(joules_write=True)
            with conn.begin():
                if not db.is_sqlite:
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _ADVISORY_LOCK_KEY})
                cfg = alembic_config(conn)
                current = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}) \
                    .get_current_heads()
                script = ScriptDirectory.from_config(cfg)
                known = {r.revision for r in script.walk_revisions()}
                unknown = [r for r in current if r not in known]
                if unknown:
                    raise JoulesError(
                        f"database {safe_url(db.url)} is at migration {', '.join(unknown)}, which this "
                        f"version of joules does not know (its latest is {script.get_current_head()}): a "
                        "newer joules has upgraded it; serve it with that version, or upgrade joules")
                command.upgrade(cfg, revision)

    if db.is_sqlite:
        with _sqlite_file_lock(Path(str(db.url.database) + ".migrate-lock")):
            run()
    else:
        run()


def downgrade(db: Database, revision: str = "base") -> None:
    """Undo migrations down to ``revision`` (tests and maintenance only)."""
    from alembic import command

    with db.engine.connect() as conn:
        conn.execution_options(joules_write=True)
        with conn.begin():
            command.downgrade(alembic_config(conn), revision)


def current_revision(db: Database) -> str | None:
    """The revision the database is at (``None``: never migrated)."""
    from alembic.runtime.migration import MigrationContext

    with db.engine.connect() as conn:
        conn.execution_options(joules_write=False)
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


def head_revision() -> str:
    """The newest revision of the bundled migrations."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head
