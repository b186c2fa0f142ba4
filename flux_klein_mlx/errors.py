"""The one exception type the CLI turns into a one-line message, and the one notice category."""


class FluxKleinError(Exception):
    """A problem the user can fix (bad input, wrong or damaged weights, missing files).

    The message is a single sentence that says what is wrong and what to do; the CLI prints it
    without a traceback and exits non-zero.
    """


class Notice(UserWarning):
    """Not a problem: a line to see before something long starts (a large download). Issued with
    `warnings.warn(message, Notice)`; the CLI prints it as it is, without "warning: "."""
