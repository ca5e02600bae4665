"""Errors of loading files: each message names the file, what is wrong and how to fix it."""


class ModelLoadError(RuntimeError):
    """A model file is missing, corrupt or unsupported; the message says which and why."""


class DrafterMismatchError(ValueError):
    """The drafter checkpoint does not fit the target model (or is malformed)."""
