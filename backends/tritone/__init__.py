"""Tritone: the engine and text helpers behind the Triton models. Never imports Triton."""

__version__ = "0.1.0"
