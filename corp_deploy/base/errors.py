"""The one exception type users see."""


class CorpError(Exception):
    """A problem with the user's input or environment, stated in one line that says what to do.

    The CLI prints it without a traceback and exits non-zero; anything else is a bug.
    """


def first_line(e: BaseException) -> str:
    """An exception's first line (or its type when it has no message): for one-line errors that cite a cause."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
