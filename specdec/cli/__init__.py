"""Shared CLI plumbing: user errors print one line and exit non-zero, no traceback."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import traceback

from specdec.errors import SpecDecError

EXIT_USER_ERROR = 2
_verbose = False  # set by setup_logging: -v prints the traceback of a user error too


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose option errors are user errors (one `error: ...` line, exit 2) instead
    of a usage block."""

    def error(self, message: str):
        raise SpecDecError(f"{message} (see {self.prog} --help)")


def user_errors(main):
    """Wrap a CLI main: a SpecDecError -> one line 'error: ...' on stderr (after its
    traceback with -v) and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except SpecDecError as e:
            if _verbose:
                traceback.print_exc()
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper


def setup_logging(verbose: bool = False) -> None:
    global _verbose
    _verbose = verbose
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
