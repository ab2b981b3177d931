"""The server's Alembic migrations: from an empty database, matching the models, safe to run at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from joules.errors import JoulesError
from joules.servers.batch_size import db as dbm

TABLES = {"bso_jobs", "bso_trials", "bso_epoch_reports", dbm.VERSION_TABLE}


def test_migrations_ship_inside_the_package() -> None:
    import joules.servers.batch_size.migrations as package
    import joules.servers.batch_size.migrations.versions as versions

    assert Path(package.__file__).parent == dbm.MIGRATIONS_DIR
    assert (dbm.MIGRATIONS_DIR / "env.py").is_file()
    shipped = sorted(p.name for p in Path(versions.__file__).parent.glob("0*.py"))
    assert shipped == ["0001_initial_schema.py", "0002_trial_last_activity.py",
                       "0003_epoch_report_bigint_id.py"]
    assert dbm.head_revision() == "0003"


def test_upgrade_from_empty_matches_models_and_downgrades(bso_backend: str,
                                                          bso_databases: Callable[[str], str]) -> None:
    db = dbm.Database(bso_databases(bso_backend))
    try:
        assert dbm.current_revision(db) is None
        dbm.upgrade(db)
        assert dbm.current_revision(db) == dbm.head_revision()
        assert TABLES <= set(inspect(db.engine).get_table_names())
        with db.engine.connect() as conn:
            opts = {"version_table": dbm.VERSION_TABLE, "compare_type": True}
            ctx = MigrationContext.configure(conn, opts=opts)
            assert compare_metadata(ctx, dbm.Base.metadata) == []
        if bso_backend == "postgresql":  # one id sequence serves every job: 64 bits
            with db.engine.connect() as conn:
                kinds = conn.execute(text(
                    "SELECT c.data_type, s.data_type FROM information_schema.columns c, "
                    "information_schema.sequences s WHERE c.table_name = 'bso_epoch_reports' "
                    "AND c.column_name = 'id' AND s.sequence_name = 'bso_epoch_reports_id_seq'")).one()
            assert tuple(kinds) == ("bigint", "bigint")
        dbm.upgrade(db)  # again: nothing to do
        dbm.downgrade(db, "base")
        left = set(inspect(db.engine).get_table_names())
        assert not ({"bso_jobs", "bso_trials", "bso_epoch_reports"} & left)
        dbm.upgrade(db)
        assert dbm.current_revision(db) == dbm.head_revision()
    finally:
        db.dispose()


def test_concurrent_upgrades_are_safe(bso_backend: str, bso_databases: Callable[[str], str]) -> None:
    """Server workers that start together all migrate; one does the work, the others find it done."""
    url = bso_databases(bso_backend)
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def migrate() -> None:
        db = dbm.Database(url, pool_size=1)
        try:
            barrier.wait()
            dbm.upgrade(db)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            db.dispose()

    threads = [threading.Thread(target=migrate) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "migrations hung"
    assert not errors, errors
    db = dbm.Database(url)
    assert dbm.current_revision(db) == dbm.head_revision()
    db.dispose()


@pytest.mark.parametrize(("url", "message"), [
    ("mysql://u@h/db", "unsupported database 'mysql'"),
    ("sqlite://", "in-memory SQLite"),
    ("sqlite:///:memory:", "in-memory SQLite"),
    ("sqlite:///file::memory:?uri=true", "URI filenames"),
    ("sqlite:///file:/tmp/x.db?uri=true", "URI filenames"),
    ("postgresql://u@h:5432", "names no database"),
    ("postgresql+asyncpg://u@h/db", "unsupported PostgreSQL driver"),
    ("::::", "bad database URL"),
    ("", "empty database URL"),
])
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(JoulesError, match=message):
        dbm.normalize_url(url)


def test_url_normalization(tmp_path: Path) -> None:
    assert dbm.normalize_url("postgres://u:pw@h/db").render_as_string(False) == "postgresql+psycopg://u:pw@h/db"
    assert dbm.normalize_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    path = tmp_path / "x.sqlite"
    assert dbm.normalize_url(str(path)).database == str(path)
    assert dbm.safe_url(dbm.normalize_url("postgresql://u:secret@h/db")) == "postgresql+psycopg://u:***@h/db"


def test_sqlite_urls_name_one_file_whatever_the_directory(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``~`` is the home and a relative path is made absolute: a server started elsewhere finds its state."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home_db = str(tmp_path / "home/bso/state.sqlite")
    assert dbm.normalize_url("sqlite:///~/bso/state.sqlite").database == home_db
    monkeypatch.chdir(tmp_path)
    assert dbm.normalize_url("sqlite:///rel/s.sqlite").database == str(tmp_path / "rel/s.sqlite")
    db = dbm.Database("sqlite:///~/bso/state.sqlite")
    try:
        dbm.upgrade(db)
    finally:
        db.dispose()
    assert (tmp_path / "home/bso/state.sqlite").is_file()
    assert not (tmp_path / "~").exists()


def test_serve_workers_skip_the_migrations_their_parent_ran(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``joules serve --workers N`` migrates once; its workers (``app_from_env``) do not again."""
    from joules.servers.batch_size.app import app_from_env
    from joules.servers.batch_size.settings import DB_ENV, MIGRATED_ENV

    url = f"sqlite:///{tmp_path / 'bso.sqlite'}"
    db = dbm.Database(url)
    try:
        monkeypatch.setenv(DB_ENV, url)
        monkeypatch.setenv(MIGRATED_ENV, url)
        app_from_env()
        assert dbm.current_revision(db) is None  # the parent said this database is migrated
        monkeypatch.setenv(MIGRATED_ENV, f"sqlite:///{tmp_path / 'another.sqlite'}")
        app_from_env()
        assert dbm.current_revision(db) == dbm.head_revision()  # another database: migrated
        dbm.downgrade(db, "base")
        monkeypatch.delenv(MIGRATED_ENV)
        app_from_env()
        assert dbm.current_revision(db) == dbm.head_revision()  # plain uvicorn --factory: migrated
    finally:
        db.dispose()


def test_a_plain_path_names_exactly_that_file(tmp_path: Path) -> None:
    """A plain path was pasted into a URL and parsed: "%41" became "A" and "?" cut the name."""
    for name in ("run%41.sqlite", "what?.sqlite", "a b#c.sqlite"):
        path = tmp_path / name
        url = dbm.normalize_url(str(path))
        assert url.database == str(path)
        assert dbm.normalize_url(url.render_as_string(hide_password=False)).database == str(path)
        db = dbm.Database(str(path))
        try:
            dbm.upgrade(db)
        finally:
            db.dispose()
        assert path.is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".sqlite") == sorted(
        ["run%41.sqlite", "what?.sqlite", "a b#c.sqlite"])


def test_a_database_migrated_by_a_newer_joules_is_a_clear_error(tmp_path: Path) -> None:
    """Alembic's own error (a traceback from ``joules serve``) named only the revision."""
    import subprocess
    import sys

    path = tmp_path / "bso.sqlite"
    db = dbm.Database(str(path))
    try:
        dbm.upgrade(db)
        with db.engine.begin() as conn:
            conn.execute(text(f"UPDATE {dbm.VERSION_TABLE} SET version_num = '0099'"))
        unknown = r"at migration 0099, which this version of joules does not know \(its latest is 0003\)"
        with pytest.raises(JoulesError, match=unknown):
            dbm.upgrade(db)
    finally:
        db.dispose()
    joules = str(Path(sys.executable).parent / "joules")
    r = subprocess.run([joules, "serve", "--db", str(path), "--port", "65432"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("joules: error: database") and "0099" in r.stderr, r.stderr
