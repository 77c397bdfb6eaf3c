"""The package version, in a leaf module so that nothing imports the package root from below."""

__version__ = "0.2.0"
