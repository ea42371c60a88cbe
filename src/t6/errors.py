"""The errors a user can fix: a setting, an input file, a server, the machine's room.

Each is raised on purpose, where the project checks what it was asked for, with a message that names the field
or file and the fix. The entry scripts' one boundary (`t6.cli.entry`) prints such an error as one line and exits
with code 2. Any other exception is a bug: it keeps its traceback (exit 1), even a ValueError.

Each type is also the built-in exception its kind of problem has always been (a missing file is a
FileNotFoundError, a bad value a ValueError), so code that catches those still does. This module imports nothing:
every layer raises these.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for; its message says what and how to fix it."""


class SettingError(UserError, ValueError):
    """A setting or argument out of its range, or settings that contradict each other."""


class ConfigError(SettingError):
    """A configuration's problems, every one at once, each naming its field and the fix."""

    def __init__(self, what: str, problems: list[str]):
        self.what, self.problems = what, list(problems)
        super().__init__(f"{what}:\n  - " + "\n  - ".join(self.problems))

    def __reduce__(self):  # a sweep's job error crosses processes (joblib, submitit) pickled
        return type(self), (self.what, self.problems)


class MissingFile(UserError, FileNotFoundError):
    """An input file or directory that is not there."""


class DamagedFile(UserError, ValueError):
    """An input file that is there but does not read: truncated, corrupted, or of another kind or version."""


class Unreachable(UserError, ConnectionError):
    """A server or store the run needs does not answer, or cannot be opened."""


class NoRoom(UserError, MemoryError):
    """What was asked for does not fit the machine: a batch in the device's memory, a file on its disk."""


class UnknownName(UserError, KeyError):
    """A name that is not one of those known: a mechanism, a task, a benchmark."""

    def __str__(self) -> str:  # the message, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


class UserExit(SystemExit):
    """A UserError on its way through code that turns every Exception into something else: a Hydra callback's are
    only warned about, and the run would go on. The boundary (t6.cli.entry) says `error` as it says a UserError,
    exit 2."""

    def __init__(self, error: UserError):
        super().__init__(2)
        self.error = error


class Diverged(UserError, FloatingPointError):
    """Training met a NaN or inf loss: the message names the step, the last good checkpoint and the settings to
    change (the learning rate, nonfinite_loss=skip)."""
