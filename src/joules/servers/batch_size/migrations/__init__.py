"""Alembic migrations of the batch-size server's database.

Applied by :func:`joules.servers.batch_size.db.upgrade`.

A package (with ``versions/`` one too) so that setuptools ships them with joules.
"""
