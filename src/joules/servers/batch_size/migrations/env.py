"""Alembic environment: runs on the connection that :func:`joules.servers.batch_size.db.upgrade` passes in.

Used without one (the ``alembic`` command with ``-x url=...``), it connects to that URL.
"""

from __future__ import annotations

from alembic import context

from joules.servers.batch_size.db import VERSION_TABLE, Base, make_engine

config = context.config


def run_migrations() -> None:
    """Run the migrations online, on the given connection or a new one."""
    connection = config.attributes.get("connection")
    if connection is None:
        url = context.get_x_argument(as_dictionary=True).get("url")
        if not url:
            raise SystemExit("pass the database with: alembic -x url=sqlite:///PATH ...")
        engine = make_engine(url)
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
        engine.dispose()
        return
    _run(connection)


def _ours(name: str | None, type_: str, _parent_names: object) -> bool:
    """Autogenerate looks only at the server's own tables: the database may hold others."""
    return type_ != "table" or (name or "").startswith("bso_")


def _run(connection: object) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        include_name=_ours,
        version_table=config.get_main_option("version_table") or VERSION_TABLE,
        render_as_batch=True,  # SQLite cannot ALTER most things: later migrations copy tables
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
