"""tenant quotas (monthly GPU hours, concurrent builds) and admin tokens

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 12:20:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpu_hours_per_month', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('max_concurrent_builds', sa.Integer(), nullable=True))
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.add_column(sa.Column('is_admin', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.drop_column('is_admin')
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('max_concurrent_builds')
        batch_op.drop_column('gpu_hours_per_month')
