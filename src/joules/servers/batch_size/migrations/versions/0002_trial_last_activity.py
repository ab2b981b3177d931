"""Trials' last activity, for expiring the running trials of dead clients.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

EPOCH_START = "'1970-01-01 00:00:00'"  # as db.EPOCH_START; a migration does not import the models


def upgrade() -> None:
    """Add ``bso_trials.last_activity_at``: existing rows get their latest report's time, else creation's."""
    op.add_column("bso_trials", sa.Column("last_activity_at", sa.DateTime(timezone=True),
                                          server_default=sa.text(EPOCH_START), nullable=False))
    op.execute(
        "UPDATE bso_trials SET last_activity_at = COALESCE("
        "(SELECT MAX(r.created_at) FROM bso_epoch_reports r WHERE r.trial_id = bso_trials.id), "
        "bso_trials.created_at)")


def downgrade() -> None:
    """Drop ``bso_trials.last_activity_at``."""
    op.drop_column("bso_trials", "last_activity_at")
