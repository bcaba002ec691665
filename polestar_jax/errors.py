"""User-facing errors.

Every problem a user can cause (bad paths, corrupt checkpoints, invalid options) is raised as a
:class:`PolestarError` with a one-line message; the command-line entry points print that line and exit
with status 2 instead of showing a traceback.
"""
from __future__ import annotations


class PolestarError(ValueError):
    """An error in the user's input: a missing file, a corrupt checkpoint, an invalid option."""


class CheckpointError(PolestarError):
    """A checkpoint folder or file is missing, corrupt, or does not match the config."""


class ConfigError(PolestarError):
    """A model or decode configuration is invalid or describes an unsupported architecture."""
