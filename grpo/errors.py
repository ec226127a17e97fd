"""Typed errors the CLI turns into one-line messages with exit code 2."""


class GRPOPlatformError(Exception):
    """Base class for errors caused by user input (config, data, run directory), not by a bug."""


class ConfigError(GRPOPlatformError, ValueError):
    """The experiment config is invalid; raised at load time, before any model is built."""


class DataError(GRPOPlatformError, ValueError):
    """A dataset is missing, unreadable or has no usable rows."""


class RunDirectoryError(GRPOPlatformError):
    """A run directory exists and would be overwritten, or a resume has nothing to resume from."""
