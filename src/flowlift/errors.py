"""The one exception type for user errors.

Anything a user can cause (a bad path, a wrong weight file, an unreadable image, an impossible
option) raises :class:`FlowliftError` with a one-line message. The CLI prints that line and exits
non-zero without a traceback; programming errors keep their tracebacks.
"""


class FlowliftError(Exception):
    """A user-facing error whose message is one clear line; the command line exits with :attr:`exit_status`."""

    #: 2, a user error; a subclass for an outcome that is no user's mistake says otherwise.
    exit_status: int = 2
