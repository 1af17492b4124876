"""Alembic migrations of the registry schema (run by ``edged-registry migrate`` and at ``serve`` start)."""
