"""The one exception type spectrain raises for bad input.

Command-line entry points catch it and print ``error: <message>`` without a
traceback, so every message must name the offending file, key or value.
"""


class SpectrainError(ValueError):
    """Bad input: a missing file, a malformed record, incompatible shapes."""


def run_command(fn, *args):
    """Run a command's body; a :class:`SpectrainError` becomes ``error: <message>`` on stderr and exit code 2."""
    import sys

    try:
        return fn(*args)
    except SpectrainError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
