import json
import logging
import subprocess
import sys

from lightning_diag.core.log_handler import ensure_handler


def _real(logger: logging.Logger) -> list[logging.Handler]:
    return [h for h in logger.handlers if not isinstance(h, logging.NullHandler)]


def test_import_installs_only_a_null_handler():
    code = (
        "import json, logging, lightning_diag\n"
        "lg = logging.getLogger('lightning_diag')\n"
        "print(json.dumps([[type(h).__name__ for h in lg.handlers], lg.propagate, lg.level]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [["NullHandler"], True, logging.NOTSET]


def test_handler_is_installed_once_when_nothing_would_show_the_records():
    app = logging.getLogger("ld_test_bare")
    app.propagate = False  # stands for a script whose root logger has no handler
    logger = logging.getLogger("ld_test_bare.lightning_diag")
    try:
        assert ensure_handler(logger) is True
        assert ensure_handler(logger) is False
        assert len(_real(logger)) == 1 and logger.level == logging.INFO and logger.propagate is False
    finally:
        logger.handlers.clear()


def test_an_application_that_configured_logging_keeps_control():
    app = logging.getLogger("ld_test_app")
    app.propagate = False
    app.addHandler(logging.StreamHandler())
    logger = logging.getLogger("ld_test_app.lightning_diag")
    try:
        assert ensure_handler(logger) is False
        assert _real(logger) == [] and logger.propagate is True and logger.level == logging.NOTSET
    finally:
        app.handlers.clear()


def test_callback_setup_makes_alerts_visible(monkeypatch):
    import lightning_diag.callbacks.common.base as base

    calls = []
    monkeypatch.setattr(base, "ensure_handler", lambda: calls.append(1))
    monkeypatch.setattr(base, "_attach", lambda trainer, callback: None)
    base.DiagCallback().setup(None, None, "validate")  # type: ignore[arg-type]
    assert calls == [1]
