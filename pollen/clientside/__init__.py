"""Client-side pieces any Flower ClientApp can use (mods, helpers)."""

from pollen.clientside.compression_mod import compression_mod

__all__ = ["compression_mod"]
