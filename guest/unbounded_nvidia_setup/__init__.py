"""Builds a self-contained NVIDIA driver root and CDI spec inside a GPU node machine."""

__version__ = "0.1.0"
