"""``diag/run.json`` stores no secret: the command line's secret-looking values are redacted in both forms (issue 36).

The file is uploaded with the run (MLflow artifacts), so ``--api-key S3CRET --db-password hunter3`` must not be
kept verbatim, nor ``--key=value``, ``name=value`` overrides, access-token-shaped values or a URL's password.
"""

from __future__ import annotations

import json
import sys

import pytest
import pytorch_lightning as pl

from lightning_diag import AnomalyAlarm
from lightning_diag.callbacks.common.provenance import REDACTED, is_secret_key, redact_command
from tests.output.logger_models import FAST, Regression

R = REDACTED


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # the case: a space between the option and its value
        (
            ["train.py", "--api-key", "S3CRET", "--db-password", "hunter3"],
            ["train.py", "--api-key", R, "--db-password", R],
        ),
        # the `=` form keeps the name and redacts the value (it used to drop the whole argument)
        (["train.py", "--api-key=S3CRET", "--lr=0.1"], ["train.py", f"--api-key={R}", "--lr=0.1"]),
        # a single dash, and a value that looks like a negative number
        (["t", "-token", "abc", "-password", "-123"], ["t", "-token", R, "-password", R]),
        # an option after a secret-looking flag is not its value
        (["t", "--use-auth", "--lr", "0.1", "data.csv"], ["t", "--use-auth", "--lr", "0.1", "data.csv"]),
        # a positional after a secret-looking flag is taken as its value
        (["t", "--hf-token", "data.csv"], ["t", "--hf-token", R]),
        # Hydra / LightningCLI overrides without dashes, and dotted LightningCLI options
        (["fit", "db.password=hunter3", "model.lr=0.1"], ["fit", f"db.password={R}", "model.lr=0.1"]),
        (["fit", "--model.init_args.api_key", "S3CRET"], ["fit", "--model.init_args.api_key", R]),
        # the word `key`, and environment-style names
        (
            ["t", "--key", "k1", "--ssh-key=k2", "AWS_SECRET_ACCESS_KEY=k3"],
            ["t", "--key", R, f"--ssh-key={R}", f"AWS_SECRET_ACCESS_KEY={R}"],
        ),
        # values shaped like access tokens, whatever their name, and a URL's password
        (["t", "hf_abcdefghijklmnop", "--note=sk-abcdefghijklmnop"], ["t", R, f"--note={R}"]),
        (["t", "--uri", "https://me:pw0rd@host/x"], ["t", "--uri", f"https://me:{R}@host/x"]),
        # nothing secret: unchanged
        (["t", "--keyframes", "4", "--max-steps", "10", "-v"], ["t", "--keyframes", "4", "--max-steps", "10", "-v"]),
        ([], []),
    ],
)
def test_redact_command(argv, expected):
    assert redact_command(argv) == expected


@pytest.mark.parametrize(
    "name",
    ["api_key", "--db-password", "HF_TOKEN", "client_secret", "credentials", "auth", "key", "sshKey", "KEYS", "pwd"],
)
def test_secret_names(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ["lr", "keyframes", "monkey", "--max-steps", "hidden_size", "seed"])
def test_plain_names(name):
    assert not is_secret_key(name)


class KeyedModel(Regression):
    def __init__(self, ssh_key: str = "id_rsa_contents", hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_run_json_redacts_the_command_line_and_keeps_no_secret(tmp_path, monkeypatch):
    argv = [
        "train.py",
        "--api-key",
        "S3CRET",
        "--db-password",
        "hunter3",
        "--token=tok-123",
        "--lr",
        "0.1",
        "--tracking-uri",
        "https://me:pw0rd@mlflow.example/x",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("MY_SERVICE_API_TOKEN", "env-secret-value")
    trainer = pl.Trainer(max_steps=2, default_root_dir=tmp_path, callbacks=[AnomalyAlarm()], logger=False, **FAST)
    trainer.fit(KeyedModel())
    text = (tmp_path / "diag" / "run.json").read_text()
    record = json.loads(text)
    assert record["command"] == [
        "train.py",
        "--api-key",
        R,
        "--db-password",
        R,
        f"--token={R}",
        "--lr",
        "0.1",
        "--tracking-uri",
        f"https://me:{R}@mlflow.example/x",
    ]
    for secret in ("S3CRET", "hunter3", "tok-123", "pw0rd", "env-secret-value", "id_rsa_contents"):
        assert secret not in text
    assert record["hyperparameters"] == {"hidden": 16}  # the secret-looking key is dropped
