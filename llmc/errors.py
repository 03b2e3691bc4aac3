"""One exception type for mistakes a user can make (bad file, bad flag, shape a kernel refuses).

The CLIs catch LLMCError and print its message as one line, then exit non-zero: a user never sees a
traceback for their own mistake. Programming errors stay ordinary exceptions with tracebacks.
"""


class LLMCError(Exception):
    """A user-facing error: the message is one line naming the file/flag and what was expected."""


class VariantRefused(LLMCError):
    """A kernel variant cannot take the requested shape (raised at model build, never at launch)."""
