"""The error every config.json reader raises (kept apart so that the per-family readers can share it)."""


class ModelConfigError(ValueError):
    """The checkpoint's config.json describes a model ninfer-rt cannot run (one-line message)."""
