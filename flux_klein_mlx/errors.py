"""The one exception type the CLI turns into a one-line message, the one notice category, and
the one way such a message lists names (`first_few`: every wing words its errors with it)."""


class FluxKleinError(Exception):
    """A problem the user can fix (bad input, wrong or damaged weights, missing files).

    The message is a single sentence that says what is wrong and what to do; the CLI prints it
    without a traceback and exits non-zero.
    """


class Notice(UserWarning):
    """Not a problem: a line to see before something long starts (a large download). Issued with
    `warnings.warn(message, Notice)`; the CLI prints it as it is, without "warning: "."""


def first_few(names, n: int = 3) -> str:
    """The first `n` names for a one-line message, then ", ..." when there are more: "a, b, c, ..."."""
    names = [str(name) for name in names]
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")
