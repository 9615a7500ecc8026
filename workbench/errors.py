"""``InputError``: bad input from the user (a spec, a file, a device, a config value), as opposed to a
bug. Its message names the input and what to do; the CLI prints it as one line, no traceback."""


class InputError(ValueError):
    """A problem with what the user asked for; the message says which input and how to fix it."""


__all__ = ["InputError"]
