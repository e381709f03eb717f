"""The one exception type for user errors.

Anything a user can cause (a bad path, a wrong weight file, an unreadable image, an impossible
option) raises :class:`FlowliftError` with a one-line message. The CLI prints that line and exits
non-zero without a traceback; programming errors keep their tracebacks.
"""


class FlowliftError(Exception):
    """A user-facing error whose message is one clear line."""
