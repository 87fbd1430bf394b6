"""The package version, in a leaf so that submodules never import the package root."""

__version__ = "0.1.0"
