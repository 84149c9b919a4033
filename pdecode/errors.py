"""Errors pdecode raises for bad input: each message says what to fix."""


class PdecodeError(ValueError):
    """Base class: invalid input or configuration detected before any computation runs. ``cli``: the same advice in
    the terms of the ``pdecode`` command (flags instead of Python calls), which the command prints instead."""

    def __init__(self, message: str = "", cli: str | None = None):
        super().__init__(message)
        self.cli = cli

    def for_cli(self) -> str:
        return self.cli or str(self)


class ConfigError(PdecodeError):
    """A model or method configuration that cannot work (mismatched sizes, unknown family, ...)."""


class CheckpointError(PdecodeError):
    """A checkpoint that is missing, malformed or does not match its config."""


class InputError(PdecodeError):
    """Prompts or generation arguments that cannot be served (too long, invalid sampling values, ...)."""
