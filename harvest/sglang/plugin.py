"""Entry point of harvest's SGLang plugin (group ``sglang.srt.plugins``).

SGLang calls :func:`load` in every process it starts (the engine and each scheduler
subprocess). For now the plugin only checks the SGLang version and says that it loaded;
the co-location hooks arrive with the co-location issue.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

from harvest.sglang import SUPPORTED_SGLANG_VERSION

logger = logging.getLogger("harvest.sglang.plugin")

LOADED_MESSAGE = "harvest plugin loaded"


def load() -> None:
    version = importlib.metadata.version("sglang")
    if version != SUPPORTED_SGLANG_VERSION:
        # Hooks target SGLang internals that move between versions: refuse at start-up
        # rather than misbehave mid-serving.
        raise RuntimeError(
            f"harvest supports sglang=={SUPPORTED_SGLANG_VERSION}, found {version}; "
            "install the supported version or uninstall harvest's plugin"
        )
    logger.info("%s (sglang %s, pid %d)", LOADED_MESSAGE, version, os.getpid())
