"""The one exception type users see as a single line instead of a traceback."""


class TrainkitError(Exception):
    """A problem with the user's input or environment, stated with how to fix it.

    Entry points print ``str(error)`` as one line and exit non-zero; library users can catch it.
    """


class ConfigError(TrainkitError, ValueError):
    """A config value of the wrong type or out of range."""


def one_line(err: BaseException, limit: int = 300) -> str:
    """``err``'s message with its whitespace folded, for embedding in a one-line error."""
    return " ".join(str(err).split())[:limit] or type(err).__name__
