"""harvest's logger: one ``harvest`` logger with its own stderr handler.

harvest code runs inside SGLang's processes, where the plugin is loaded before SGLang
configures the root logger (``configure_logger``), and root's configuration differs per
process. Owning the handler makes harvest's messages appear in every process, at the
level set by HARVEST_LOG_LEVEL, tagged so they are easy to grep in a server log.
"""

from __future__ import annotations

import logging
import sys

from harvest import config_env

_ROOT_NAME = "harvest"


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (as logging's own
    last-resort handler does), not the stream of the moment the logger was first used:
    a caller that swaps stderr (pytest's capture, a CLI redirect) must not leave harvest
    writing to a closed file."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def get_logger(name: str) -> logging.Logger:
    """A child of the ``harvest`` logger (``name`` is usually ``__name__``)."""
    root = logging.getLogger(_ROOT_NAME)
    if not root.handlers:
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s harvest pid=%(process)d] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(config_env.log_level())
        root.propagate = False  # SGLang's root handler would print everything twice
    return logging.getLogger(name if name.startswith(_ROOT_NAME) else f"{_ROOT_NAME}.{name}")
