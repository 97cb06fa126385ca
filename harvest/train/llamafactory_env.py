"""Importing LlamaFactory the way harvest needs it: the environment it wants, its logs on
stderr, and one job at a time through its parser and transformers' loading."""

from __future__ import annotations

import logging
import os
import threading

# LlamaFactory's argument parsing and transformers' model loading change process-global
# state while they run: HfArgumentParser rewrites the type of TrainingArguments' shared
# dataclass fields, from_pretrained sets torch's default dtype and swaps out
# PreTrainedModel.tie_weights, restoring each on the way out. Two jobs built at once on
# two threads (a server's job queue starts several) interleave those changes: seen as
# "LlamaFactory rejected the job: Only `Union[X, NoneType]` is allowed ... field 'debug'",
# and a swap restored in the wrong order would stay for the process's life. Every such
# section runs under this lock (reentrant: a build parses, prepares data and loads).
LOADING_LOCK = threading.RLock()


def import_llamafactory():
    """Import LlamaFactory with the environment it needs in this stack.

    sglang 0.5.23 pins transformers 5.19 while llamafactory 0.9.5 declares <= 5.6; the
    combination works (see notes/sglang-on-cpu.md) but LlamaFactory refuses to import
    without DISABLE_VERSION_CHECK. Its INFO logging is lowered unless the user chose.
    """
    os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
    os.environ.setdefault("LLAMAFACTORY_VERBOSITY", "WARN")
    _quiet_version_check_warning()
    import llamafactory  # noqa: F401

    _llamafactory_logs_to_stderr()
    return llamafactory


_VERSION_CHECK_WARNING = "Version checking has been disabled"


def _quiet_version_check_warning() -> None:
    """Drop LlamaFactory's import-time warning that the version check is off: harvest turns
    it off on purpose (above), and the line otherwise precedes every message of every
    command that reads a job (``harvest train``'s one-line errors among them)."""
    logger = logging.getLogger("llamafactory.extras.misc")  # the logger LlamaFactory will fetch
    if not any(getattr(f, "harvest_version_check", False) for f in logger.filters):
        quiet = logging.Filter()
        quiet.filter = lambda record: not str(record.msg).startswith(_VERSION_CHECK_WARNING)
        quiet.harvest_version_check = True
        logger.addFilter(quiet)


def _llamafactory_logs_to_stderr() -> None:
    """LlamaFactory's handler writes to the stdout of the moment it was imported; move its
    messages to the current stderr, where logs belong (``harvest train --check`` prints its
    plan on stdout). Skipped if LlamaFactory's logging module changes shape."""
    from harvest.logs import StderrHandler

    try:
        from llamafactory.extras import logging as lf_logging

        lf_logging._configure_library_root_logger()
        old, root = lf_logging._default_handler, lf_logging._get_library_root_logger()
    except (ImportError, AttributeError):
        return
    if old is None or isinstance(old, StderrHandler):
        return
    new = StderrHandler()
    new.setFormatter(old.formatter)
    new.setLevel(old.level)
    root.removeHandler(old)
    root.addHandler(new)
    lf_logging._default_handler = new
