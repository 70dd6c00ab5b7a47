"""User-facing errors.

Every mistake a user can make (bad paths, incompatible target/drafter, invalid
sampling parameters, context overflow, unsupported dtype) raises
:class:`DFlashError` with a one-line message. The CLI prints that line and exits
non-zero; the server turns it into an HTTP 400.
"""


class DFlashError(ValueError):
    """A user error with a one-line, human-readable message."""
