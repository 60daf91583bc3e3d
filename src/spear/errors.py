"""The one exception type users meet. The CLI prints its message on one line and exits 2."""


class SpearError(Exception):
    """A problem the user can fix: bad path, unsupported model, impossible setting."""
