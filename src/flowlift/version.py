"""The version of flowlift, at the bottom of the house so that every layer may record it (outputs' metadata)."""

__version__ = "0.1.0"
