"""Errors shared across the packages (imports nothing)."""


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says which and why."""
