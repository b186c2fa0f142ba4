"""The one exception type the CLI turns into a one-line message, the one notice category, and
the one way such a message lists names (`first_few`) and quotes a stranger's text (`quoted`): every wing
words its errors with them.

A run's settings come through three doors, each with its own names for them: the CLI's options
(--init-image), Python's keywords (init_image=) and the server's fields (image). A message names a
setting once, as {name} from `SETTING_NAMES` ("give {init_image}"), and each door shows it in its own
words: the CLI `e.worded("cli")`, the server `e.worded("http")`, Python `str(e)`.
"""

import re

DOORS = ("cli", "python", "http")
# setting -> its name at each door of DOORS (the server's fields: serve/forms.py; an edit's first upload is
# the image repainted, the rest references; `size` is "WxH").
SETTING_NAMES = {
    "init_image": ("--init-image", "init_image=", "image"),
    "mask": ("--mask", "mask=", "mask"),
    "size": ("--width/--height", "width=/height=", "size"),
    "strength": ("--strength", "strength=", "strength"),
    "images": ("--image", "images=", "image"),
    "outpaint": ("--outpaint", "outpaint=", "outpaint"),
    "prompt": ("--prompt", "prompt", "prompt"),
    "steps": ("--steps", "steps=", "steps"),
    "upsample": ("--upsample", "upsample=True", "upsample"),
    "boxes": ("--box", "boxes=", "boxes"),
}
NAMED = re.compile(r"\{(" + "|".join(SETTING_NAMES) + r")\}")


class FluxKleinError(Exception):
    """A problem the user can fix (bad input, wrong or damaged weights, missing files).

    The message is a single sentence that says what is wrong and what to do; the CLI prints it
    without a traceback and exits non-zero. A setting in it is written {name} (see the module
    docstring); `str(e)` gives Python's names.
    """

    def worded(self, door: str) -> str:
        """The message with each {setting} named as `door` ("cli", "python", "http") names it."""
        column = DOORS.index(door)
        return NAMED.sub(lambda m: SETTING_NAMES[m[1]][column], super().__str__())

    def __str__(self) -> str:
        return self.worded("python")


class Notice(UserWarning):
    """Not a problem: a line to see before something long starts (a large download). Issued with
    `warnings.warn(message, Notice)`; the CLI prints it as it is, without "warning: "."""


def first_few(names, n: int = 3) -> str:
    """The first `n` names for a one-line message, then ", ..." when there are more: "a, b, c, ..."."""
    names = [str(name) for name in names]
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def quoted(text: str, n: int = 60) -> str:
    """A stranger's text for a one-line message: its repr (newlines escaped), cut at `n` characters."""
    return repr(text[:n]) + ("..." if len(text) > n else "")
