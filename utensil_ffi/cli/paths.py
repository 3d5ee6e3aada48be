"""The command-line programs' output paths, checked before the work: a bad path fails in a
second, not after an epoch of training or an export.

    why = writable_file_problem(path, create_dirs)   # None when a file can be written there
    tmp = temporary_name(path)                        # beside it, for an atomic os.replace
"""

import hashlib
import os

__all__ = ["writable_file_problem", "temporary_name"]

_NAME_MAX = 255  # where pathconf cannot say (Linux, macOS and Windows file systems allow 255)


def _name_max(folder):
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return _NAME_MAX


def temporary_name(path):
    """A temporary file's path in ``path``'s folder (so os.replace onto ``path`` is atomic) whose
    name is short whatever ``path``'s is: a name at the file system's limit, with a prefix and
    suffix added, would be refused (ENAMETOOLONG) only when the first save is tried."""
    path = os.path.abspath(os.fspath(path))
    tag = hashlib.sha1(os.fsencode(os.path.basename(path))).hexdigest()[:12]
    return os.path.join(os.path.dirname(path), ".%s.%d.tmp" % (tag, os.getpid()))


def writable_file_problem(path, create_dirs):
    """Why ``path`` cannot be written as a file (None if it can). ``create_dirs``: the missing
    folders above it will be made (the nearest existing one must be writable)."""
    if path == "":
        return "an empty path"
    if path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)):
        return "%s ends in a path separator, so it names a folder; give a file name" % path
    if os.path.isdir(path):
        return "%s is a directory; give a file name" % path
    if os.path.exists(path) and not os.path.isfile(path):
        return "%s exists and is not a regular file" % path
    folder = os.path.dirname(os.path.abspath(path))
    if create_dirs:  # the nearest folder that exists is where the missing ones are made
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return "the folder %s %s" % (folder, "is not a directory" if os.path.exists(folder)
                                     else "does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        return "the folder %s is not writable" % folder
    if os.path.isfile(path) and not os.access(path, os.W_OK):
        return "%s is not writable" % path
    # the names still to be made (the file's, and the missing folders') must fit the limit
    limit = _name_max(folder)
    rest = os.path.relpath(os.path.abspath(path), folder)
    for name in rest.split(os.sep):
        if len(os.fsencode(name)) > limit:
            return ("the name %s... is %d bytes long; the file system allows %d"
                    % (name[:40], len(os.fsencode(name)), limit))
    return None
