"""Entry point of harvest's SGLang plugin (group ``sglang.srt.plugins``).

SGLang calls :func:`load` in every process it starts (the engine and each scheduler
subprocess). For now the plugin only checks the SGLang version and says that it loaded;
the co-location hooks arrive with the co-location issue.

SGLang catches and logs any exception a plugin's ``load`` raises (``sglang.srt.plugins.
load_plugins``), so raising here cannot stop a server; a version mismatch is therefore
logged as an error and no hook is installed. Refusing to start belongs to a hook on the
start-up path, where an exception does propagate.
"""

from __future__ import annotations

import importlib.metadata
import os

from harvest.logs import get_logger
from harvest.sglang import SUPPORTED_SGLANG_VERSION

logger = get_logger(__name__)

LOADED_MESSAGE = "harvest plugin loaded"


def version_problem(version: str) -> str | None:
    """Why harvest cannot hook this SGLang version, or None when it can."""
    if version == SUPPORTED_SGLANG_VERSION:
        return None
    # Hooks target SGLang internals that move between versions: never guess.
    return (
        f"harvest supports sglang=={SUPPORTED_SGLANG_VERSION}, found {version}; "
        "install the supported version or uninstall harvest"
    )


def load() -> bool:
    """Plugin entry point. Returns whether harvest's hooks were installed."""
    version = importlib.metadata.version("sglang")
    problem = version_problem(version)
    if problem is not None:
        logger.error("harvest plugin NOT active: %s", problem)
        return False
    logger.info("%s (sglang %s, pid %d)", LOADED_MESSAGE, version, os.getpid())
    return True
