"""Exceptions a user can act on; the CLI prints their message as one line and exits non-zero."""


class NinferError(Exception):
    """Base of every error that carries a user-facing message."""


class FormatError(NinferError):
    """A value cannot be encoded in, or bytes do not decode as, a numeric format."""


class ArtifactError(NinferError):
    """A `.ninfer` file (or one of its parts) violates the container specification."""


class ConversionError(NinferError):
    """A source checkpoint cannot be converted (missing files, unknown architecture, bad tensors)."""
