"""The one exception type users meet. The CLI prints its message on one line and exits 2."""


class SpearError(Exception):
    """A problem the user can fix: bad path, unsupported model, impossible setting."""


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (its type's name where it has none), for a SpearError."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
