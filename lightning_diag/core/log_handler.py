"""The ``lightning_diag`` logger's visible handler, installed on first use rather than at import.

Example:
    >>> import logging
    >>> logger = logging.getLogger("lightning_diag.doctest_example")
    >>> logger.propagate = False  # an application that configured nothing above this logger
    >>> ensure_handler(logger), ensure_handler(logger)  # installed once
    (True, False)
"""

from __future__ import annotations

import logging

__all__ = ["LOGGER_NAME", "ensure_handler"]

LOGGER_NAME = "lightning_diag"
_FORMAT = "lightning_diag %(levelname)s: %(message)s"


def _configured(logger: logging.Logger) -> bool:
    """Whether the application gave ``logger`` (or an ancestor it propagates to) a real handler."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def ensure_handler(logger: logging.Logger | None = None) -> bool:
    """Give the ``lightning_diag`` logger a stream handler at INFO when no handler would show its records.

    Called when a callback is first set up (never at import), so alerts are visible in a plain script while an
    application that configured :mod:`logging` (``logging.basicConfig``, its own handlers) keeps control.

    Returns:
        Whether a handler was installed.
    """
    logger = logger or logging.getLogger(LOGGER_NAME)
    if _configured(logger):
        return False
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False
    return True
