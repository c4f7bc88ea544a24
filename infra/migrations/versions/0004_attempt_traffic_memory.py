"""attempts' traffic (bytes fetched from the store, stored into it, served by the node cache) and peak memory

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07 06:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

COLUMNS = ('bytes_fetched', 'bytes_stored', 'bytes_cached', 'peak_rss_bytes')


def upgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        for name in reversed(COLUMNS):
            batch_op.drop_column(name)
