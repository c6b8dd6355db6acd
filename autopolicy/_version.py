"""The package version, in the one module every layer may import."""

__version__ = "0.2.0"
