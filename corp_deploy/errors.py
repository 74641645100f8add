"""The one exception type users see."""


class CorpError(Exception):
    """A problem with the user's input or environment, stated in one line that says what to do.

    The CLI prints it without a traceback and exits non-zero; anything else is a bug.
    """
