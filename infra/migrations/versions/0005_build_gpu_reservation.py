"""builds' GPU-second reservation against the tenant's monthly GPU-hour quota

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07 17:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Builds queued before this reserve nothing: they count by their measured charge alone, as before.
    with op.batch_alter_table('builds', schema=None) as batch_op:
        batch_op.add_column(sa.Column('reserved_gpu_seconds', sa.Float(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('builds', schema=None) as batch_op:
        batch_op.drop_column('reserved_gpu_seconds')
