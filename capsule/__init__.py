"""Capsule: move whole running computers between machines."""

__version__ = "0.2.0.dev0"
