"""nanovllm's logging: each module logs to `logging.getLogger(__name__)`, under the `nanovllm` logger.

A library must leave logging to the application, so importing nanovllm configures nothing. Building
an engine (and the CLI) calls configure_logging(), which gives the `nanovllm` logger one handler to
stderr at INFO, in vLLM's short format (`INFO 12-01 10:40:00 [llm_engine.py:88] ...`), only where
the application has configured no logging of its own (no handler on the root logger or on
`nanovllm`). That handler does not propagate, so a root handler added later does not print each
line twice. NANOVLLM_CONFIGURE_LOGGING=0 turns it off (as VLLM_CONFIGURE_LOGGING does).
"""
import logging
import os
import sys

from tqdm.auto import tqdm

LOGGER_NAME = "nanovllm"
CONFIGURE_ENV = "NANOVLLM_CONFIGURE_LOGGING"
FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
# A progress bar shows only once its loop has run this long: a quick load or capture prints nothing.
PROGRESS_DELAY_S = 1.0

logger = logging.getLogger(LOGGER_NAME)


def configure_logging(level: str | int | None = None):
    """Set the `nanovllm` logger's level (the CLI's --log-level; None leaves it), and give it the
    default stderr handler unless the application configured logging or opted out. Idempotent."""
    if level is not None:
        logger.setLevel(level.upper() if isinstance(level, str) else level)
    if os.environ.get(CONFIGURE_ENV, "1") == "0" or logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    logger.addHandler(handler)
    logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def progress(iterable, desc: str, enabled: bool = True, **kwargs):
    """A tqdm bar over iterable, on stderr, shown after PROGRESS_DELAY_S; off where `enabled` is
    False (ranks above 0) or the `nanovllm` logger is quieter than INFO (--log-level warning)."""
    return tqdm(iterable, desc=desc, delay=PROGRESS_DELAY_S, file=sys.stderr, dynamic_ncols=True,
                disable=not (enabled and logger.isEnabledFor(logging.INFO)), **kwargs)


def format_bytes(num_bytes: int) -> str:
    """A memory size for the start-up lines: GiB from 1 GiB up, else MiB."""
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):.2f} GiB"
    return f"{num_bytes / (1 << 20):.2f} MiB"
