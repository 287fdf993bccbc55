"""``RubinError``: the base of every error rubin raises on purpose, so one ``except`` catches them all.

Each error also derives from the builtin it always was (``ValueError`` for bad arguments and options,
``RuntimeError`` for what cannot run), so existing handlers keep working. Errors raised while a graph compiles
reach the user through ``torch.compile``'s own machinery; the backend re-raises them so that the first line of
the message is rubin's (backend.py, ``RubinCompileError``); README.md's "Errors" section shows how to catch them.
"""


class RubinError(Exception):
    """Base of rubin's errors."""
