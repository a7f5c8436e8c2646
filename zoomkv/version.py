"""The package version, in one place (the package face and the adapter config both record it)."""

__version__ = "0.1.0"
