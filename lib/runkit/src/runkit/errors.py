"""The error type for mistakes a user can fix: the CLI prints it as one line and exits non-zero.

Anything else that escapes is a bug and keeps its traceback.
"""


class RunError(Exception):
    """A bad value from the user: the message names it and says what would be accepted."""

    exit_code = 2
