"""The error every user-caused model-loading failure surfaces as."""

from __future__ import annotations


class ModelLoadError(Exception):
    """The model could not be loaded; the message is one line, fit for a CLI or a log."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))
