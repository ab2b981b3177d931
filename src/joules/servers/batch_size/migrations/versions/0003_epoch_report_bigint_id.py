"""Epoch reports' ids are 64-bit on PostgreSQL.

One id sequence serves every job of a server: 32 bits would run out after about 2.1 billion
epoch reports, and every later report would fail. SQLite's ids are 64-bit already.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Widen ``bso_epoch_reports.id`` and its sequence to ``bigint`` (PostgreSQL only)."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.alter_column("bso_epoch_reports", "id", type_=sa.BigInteger(), existing_type=sa.Integer(),
                    existing_nullable=False)
    op.execute("ALTER SEQUENCE IF EXISTS bso_epoch_reports_id_seq AS bigint")


def downgrade() -> None:
    """Narrow ``bso_epoch_reports.id`` back to ``integer`` (PostgreSQL only)."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("ALTER SEQUENCE IF EXISTS bso_epoch_reports_id_seq AS integer")
    op.alter_column("bso_epoch_reports", "id", type_=sa.Integer(), existing_type=sa.BigInteger(),
                    existing_nullable=False)
