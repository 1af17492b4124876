"""The central model registry (``edged-registry``): versions, signed releases, device enrollment and reports.

Only :mod:`edged.protocol.fleet.release` and :mod:`edged.protocol.fleet.messages` are imported by
devices; the server modules need the ``registry`` extra (FastAPI, SQLAlchemy, Alembic).
"""
