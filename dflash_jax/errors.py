"""Errors of our own: one line that names the problem, caught at the CLI edge."""


class DFlashError(Exception):
    """Base class of every error the package raises on bad input."""


class ConfigError(DFlashError):
    """A config.json we cannot use (unsupported model_type, missing or bad field)."""


class CheckpointError(DFlashError):
    """A checkpoint directory or tensor set that does not match its config."""


class InputError(DFlashError):
    """Bad flags, options or input rows, found before a weight is read; the message names the
    flag (`--batch-size`) or the input line."""


def flag(setting: str) -> str:
    """A setting as the command line spells it: `batch_size` -> `--batch-size` (errors raised for a
    command name its flags; the library's name the settings themselves)."""
    return "--" + setting.replace("_", "-")
