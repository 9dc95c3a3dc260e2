"""The one exception type for bad user input (paths, names, sizes).

The CLI prints a `UsageError` as one line and exits with status 2; anything else is a bug and
keeps its traceback. The message names the bad value and the rule it broke.
"""


class UsageError(Exception):
    pass
