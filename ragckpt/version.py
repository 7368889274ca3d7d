"""The package version, on its own so that the metadata a save records can name it without
importing the `ragckpt` facade (which imports every layer)."""

__version__ = "0.1.0"
