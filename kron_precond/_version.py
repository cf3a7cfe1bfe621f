"""The package version: the one place it is written (setup.py reads it from here)."""

__version__ = "0.1.0"
