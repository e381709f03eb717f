"""The one exception type for user errors, and the one warning type beside it.

Anything a user can cause (a bad path, a wrong weight file, an unreadable image, an impossible
option) raises :class:`FlowliftError` with a one-line message. The CLI prints that line and exits
non-zero without a traceback; programming errors keep their tracebacks. :class:`FlowliftWarning` is
what flowlift warns about a user's input or output (shown as one line by the command line).
"""


class FlowliftError(Exception):
    """A user-facing error whose message is one clear line; the command line exits with :attr:`exit_status`."""

    #: 2, a user error; a subclass for an outcome that is no user's mistake says otherwise.
    exit_status: int = 2


class FlowliftWarning(UserWarning):
    """A warning flowlift raises about a user's data (an image read with a caveat, alpha dropped, a tile
    layout below FLUX.2's trained size): one line, shown once per message."""


#: Exceptions that fail one input of a batch, or one request of the web app (reported in one line), instead of
#: the whole run: a user error, a file that cannot be read or written, a model that ran out of memory.
ITEM_ERRORS: tuple[type[BaseException], ...] = (FlowliftError, OSError, RuntimeError, MemoryError, ValueError)
