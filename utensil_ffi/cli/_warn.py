"""Warnings as a command-line program's own lines, for the length of its run.

    with cli_warnings("utensil-train"):
        ...   # warnings.warn("skipping x.jpg: ...") prints "utensil-train: warning: skipping ..."

Python's default display names the library's file and line and the warning's class, which tell a
user of the program nothing; the program's name and the message do. Only ``formatwarning`` is
replaced, and only inside the block: the filters (which warnings show, how often) and where they
go stay the caller's (a test's warning recorder still gets them), and a program importing the
library keeps Python's display.
"""

import contextlib
import warnings

__all__ = ["cli_warnings"]


@contextlib.contextmanager
def cli_warnings(prog):
    saved = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        return "%s: warning: %s\n" % (prog, message)

    warnings.formatwarning = formatwarning
    try:
        yield
    finally:
        warnings.formatwarning = saved
