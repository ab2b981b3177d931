"""Initial schema: jobs, trials, epoch reports.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the three tables."""
    op.create_table(
        "bso_jobs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("policy", sa.String(length=32), nullable=False),
        sa.Column("policy_state", sa.Text(), nullable=False),
        sa.Column("stop_cost", sa.Double(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("trials_started", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_bso_jobs")),
        sa.UniqueConstraint("name", name=op.f("uq_bso_jobs_name")),
    )
    op.create_table(
        "bso_trials",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("phase", sa.String(length=16), nullable=False),
        sa.Column("stop_cost", sa.Double(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("epochs", sa.Integer(), nullable=False),
        sa.Column("time_s", sa.Double(), nullable=False),
        sa.Column("energy_j", sa.Double(), nullable=False),
        sa.Column("cost", sa.Double(), nullable=False),
        sa.Column("client", sa.String(length=200), nullable=True),
        sa.Column("request_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["bso_jobs.id"], name=op.f("fk_bso_trials_job_id_bso_jobs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_bso_trials")),
        sa.UniqueConstraint("job_id", "seq", name=op.f("uq_bso_trials_job_id_seq")),
        sa.UniqueConstraint("job_id", "request_id", name=op.f("uq_bso_trials_job_id_request_id")),
    )
    op.create_table(
        "bso_epoch_reports",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("trial_id", sa.String(length=32), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("time_s", sa.Double(), nullable=False),
        sa.Column("energy_j", sa.Double(), nullable=False),
        sa.Column("metric", sa.Double(), nullable=False),
        sa.Column("stop", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.String(length=16), nullable=True),
        sa.Column("cost", sa.Double(), nullable=False),
        sa.Column("stop_cost", sa.Double(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["trial_id"], ["bso_trials.id"],
                                name=op.f("fk_bso_epoch_reports_trial_id_bso_trials"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_bso_epoch_reports")),
        sa.UniqueConstraint("trial_id", "epoch", name=op.f("uq_bso_epoch_reports_trial_id_epoch")),
    )


def downgrade() -> None:
    """Drop the three tables."""
    op.drop_table("bso_epoch_reports")
    op.drop_table("bso_trials")
    op.drop_table("bso_jobs")
