"""The package version (bottom layer: checkpoints record it without importing the package root)."""
__version__ = "0.1.0"
