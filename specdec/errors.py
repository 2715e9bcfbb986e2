"""User-facing errors: the CLIs print their message on one line and exit non-zero, no traceback."""


class SpecDecError(Exception):
    """A user error (bad model name, corrupt file, bad option): message says what to do."""


class BackendError(SpecDecError):
    """A compute backend that was asked for cannot run here (no silent fallback)."""
