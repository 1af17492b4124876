"""The central model registry (``edged-registry``): versions, signed releases, device enrollment and reports.

Only :mod:`edged.registry.release` and :mod:`edged.registry.wire` are imported by
devices; the server modules need the ``registry`` extra (FastAPI, SQLAlchemy, Alembic).
"""
