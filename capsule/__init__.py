"""Capsule: move whole running computers between machines."""

__version__ = "0.1.0"
