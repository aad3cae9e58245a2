"""The one exception type spectrain raises for bad input.

Command-line entry points catch it and print ``error: <message>`` without a
traceback, so every message must name the offending file, key or value.
"""


class SpectrainError(ValueError):
    """Bad input: a missing file, a malformed record, incompatible shapes."""
