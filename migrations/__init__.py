"""Alembic's migrations of the oncegate schema: `env.py` and one file per change in `versions/`.

Installed, this folder is `oncegate.migrations`, so `oncegate migrate` finds it from anywhere
(`oncegate.store.migrate` runs it); in a checkout, `alembic upgrade head` beside `alembic.ini`
does too.
"""
