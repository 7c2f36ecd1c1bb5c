"""Harness for the official reference package ``dflash`` 0.1.0 (own venv; see harness.py)."""
