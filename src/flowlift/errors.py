"""The one exception type for user errors, and the one warning type beside it.

Anything a user can cause (a bad path, a wrong weight file, an unreadable image, an impossible
option) raises :class:`FlowliftError` with a one-line message. The CLI prints that line and exits
non-zero without a traceback; programming errors keep their tracebacks. :class:`FlowliftWarning` is
what flowlift warns about a user's input or output (shown as one line by the command line).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar

#: Where a message names its field: a character no path or argument can hold, put in the field's place by
#: :class:`FlowliftError` (the Python words) or :meth:`FlowliftError.worded` (a door's).
FIELD_MARK = "\0"


class FlowliftError(Exception):
    """A user-facing error whose message is one clear line; the command line exits with :attr:`exit_status`.

    ``field`` names the knob or request field the line is about, in the Python API's words (``tile_size``,
    ``prompt.embeds``: the keyword a caller wrote); the message names it at its start, or where it holds
    :data:`FIELD_MARK` (several fields: one mark each, in order; :attr:`fields`). Each door says it in its own
    words: :meth:`worded` puts the door's name in its place (the command line its option, ``--tile-size``; the web
    app its label), so the capabilities never spell a front-end's option.
    """

    #: 2, a user error; a subclass for an outcome that is no user's mistake says otherwise.
    exit_status: int = 2

    def __init__(self, message: str = "", *, field: str | tuple[str, ...] | None = None) -> None:
        fields = (field,) if isinstance(field, str) else tuple(field or ())
        if len(fields) == 1 and FIELD_MARK not in message and message.startswith(fields[0]):
            message = FIELD_MARK + message[len(fields[0]) :]
        self.fields, self.template = fields, message
        self.field = fields[0] if fields else None
        super().__init__(self.worded({}))

    def worded(self, words: dict[str, str]) -> str:
        """The message with each field (one a mark, in order) named as ``words`` maps it, else as Python does."""
        text = self.template
        for name in self.fields:
            text = text.replace(FIELD_MARK, words.get(name, name), 1)
        return text.replace(FIELD_MARK, "")


#: The words of the door running now (:func:`door_words`): what :func:`said` names each field as.
_DOOR_WORDS: ContextVar[Mapping[str, str] | None] = ContextVar("flowlift_door_words", default=None)


@contextlib.contextmanager
def door_words(words: Mapping[str, str]) -> Iterator[None]:
    """Within this block, :func:`said` names a FlowliftError's fields as ``words`` maps them: a door (the command
    line) sets its words once around its run, and the lines its batch prints per input (``flowlift.jobs.batch``),
    far from the door, speak them too. Restored on leaving (nested doors and in-process callers keep theirs)."""
    token = _DOOR_WORDS.set(dict(words))
    try:
        yield
    finally:
        _DOOR_WORDS.reset(token)


def said(error: BaseException) -> str:
    """``error``'s message as the running door says it: a FlowliftError with its fields in :func:`door_words`'
    words (the Python API's where no door set any), any other exception as ``str``."""
    if isinstance(error, FlowliftError):
        return error.worded(_DOOR_WORDS.get() or {})
    return str(error)


@contextlib.contextmanager
def from_field(field: str) -> Iterator[None]:
    """Within this block, a :class:`FlowliftError` is re-raised with ``field`` named first: a shared reader
    (:func:`flowlift.files.images.load_image`) names only the path, and its caller knows which field gave it
    (``bad.png: not an image file ...`` becomes ``--reference bad.png: ...`` on the command line). An error that
    names the field already, or a subclass of its own, passes unchanged."""
    try:
        yield
    except FlowliftError as error:
        if type(error) is not FlowliftError or field in error.fields:
            raise
        raise FlowliftError(f"{FIELD_MARK} {error.template}", field=(field, *error.fields)) from None


class FlowliftWarning(UserWarning):
    """A warning flowlift raises about a user's data (an image read with a caveat, alpha dropped, a tile
    layout below FLUX.2's trained size): one line, shown once per message."""


#: Exceptions that fail one input of a batch, or one request of the web app (reported in one line), instead of
#: the whole run: a user error, a file that cannot be read or written, a model that ran out of memory.
ITEM_ERRORS: tuple[type[BaseException], ...] = (FlowliftError, OSError, RuntimeError, MemoryError, ValueError)
