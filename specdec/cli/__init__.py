"""Shared CLI plumbing: user errors print one line and exit non-zero, no traceback."""

from __future__ import annotations

import functools
import logging
import sys

from specdec.errors import SpecDecError

EXIT_USER_ERROR = 2


def user_errors(main):
    """Wrap a CLI main: SpecDecError (and argparse-like ValueErrors raised on options) ->
    'error: ...' on stderr and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except SpecDecError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
