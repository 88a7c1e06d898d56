"""``diag/run.json``: what a run was (code, versions, hyperparameters, trainer settings, data, device), written
at fit start so that ``lightning-diag compare`` can say what changed between two runs (seed 001 §4.1)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from lightning_diag.core.files import write_text
from lightning_diag.instrument.rng import HeldGenerators

__all__ = ["REDACTED", "RUN_FILE", "is_secret_key", "redact_command", "run_record", "scrub", "write_run_record"]

RUN_FILE = "run.json"
#: What replaces a secret-looking value on the recorded command line.
REDACTED = "<redacted>"
#: Names (keys, options, environment variables) that may hold credentials: these substrings anywhere...
_SECRET_KEY = re.compile(r"(token|secret|passw|pwd|api[_-]?key|apikey|auth|credential|private[_-]?key)", re.I)
#: ...or the word ``key``/``keys`` (``--key``, ``--ssh-key``, ``AWS_SECRET_ACCESS_KEY``, ``accessKey``).
_KEY_WORDS = frozenset({"key", "keys"})
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+")
#: Values dropped whatever their key: strings shaped like well-known access tokens.
_SECRET_VALUE = re.compile(r"^(hf_|sk-|ghp_|gho_|github_pat_|xox[abpr]-|AKIA)[A-Za-z0-9_\-]{8,}")
#: The password of a URL's user info (``https://user:PASSWORD@host``).
_URL_PASSWORD = re.compile(r"(://[^/@\s:]*:)[^/@\s]+@")
#: A number, which may follow an option as its value even though it starts with ``-``.
_NUMBER = re.compile(r"^-\d")
_VERSIONS = ("torch", "pytorch-lightning", "lightning", "lightning-diag", "transformers", "numpy")
_FINGERPRINT_ITEMS = 8


def is_secret_key(key: str) -> bool:
    """Whether a name looks like it holds a credential: it contains ``token``, ``secret``, ``passw``, ``pwd``,
    ``api_key``/``apikey``, ``auth``, ``credential`` or ``private_key`` (any case), or has the word ``key`` or
    ``keys`` (words split at non-alphanumerics and camelCase).

    Example:
        >>> [is_secret_key(k) for k in ("hf_token", "--db-password", "--key", "AWS_SECRET_ACCESS_KEY", "sshKey")]
        [True, True, True, True, True]
        >>> [is_secret_key(k) for k in ("lr", "--keyframes", "monkey", "--max-steps")]
        [False, False, False, False]
    """
    if _SECRET_KEY.search(key):
        return True
    return any(word.lower() in _KEY_WORDS for word in _WORD_SPLIT.split(_CAMEL.sub("_", key)))


def _is_option(arg: str) -> bool:
    return len(arg) > 1 and arg.startswith("-") and not _NUMBER.match(arg)


def _redact_value(value: str) -> str:
    if _SECRET_VALUE.match(value):
        return REDACTED
    return _URL_PASSWORD.sub(rf"\g<1>{REDACTED}@", value)


def redact_command(argv: Sequence[str]) -> list[str]:
    """The command line with the values of secret-looking arguments replaced by :data:`REDACTED`.

    A value is redacted when its name looks secret (:func:`is_secret_key`) in either form, ``--name=value`` (also
    ``name=value`` overrides, as Hydra and LightningCLI take them) or ``--name value`` / ``-name value`` (the
    argument after the option, unless it is itself an option); and, whatever its name, when it is shaped like a
    well-known access token (``hf_...``, ``sk-...``, ``ghp_...``, ``xox?-...``, ``AKIA...``). The password of a URL
    (``https://user:PASSWORD@host``) is redacted everywhere. Names are kept, so a reader sees what was given.

    Example:
        >>> redact_command(["train.py", "--api-key", "S3CRET", "--db-password=hunter3", "--lr", "0.1"])
        ['train.py', '--api-key', '<redacted>', '--db-password=<redacted>', '--lr', '0.1']
        >>> redact_command(["fit", "model.token=abc", "--uri", "https://me:pw@host/x"])
        ['fit', 'model.token=<redacted>', '--uri', 'https://me:<redacted>@host/x']
    """
    out = list(argv[:1])
    secret_option = False
    for arg in argv[1:]:
        if secret_option and not _is_option(arg):
            out.append(REDACTED)
            secret_option = False
            continue
        secret_option = False
        name, eq, value = arg.partition("=")
        if eq and name:
            out.append(f"{name}={REDACTED}" if is_secret_key(name) else f"{name}={_redact_value(value)}")
        elif _is_option(arg) and is_secret_key(arg):
            out.append(arg)
            secret_option = True
        else:
            out.append(_redact_value(arg))
    return out


def scrub(value: Any, depth: int = 0) -> Any:
    """A JSON-ready copy of ``value`` with secret-looking keys and token-shaped strings removed.

    Example:
        >>> scrub({"lr": 0.1, "hf_token": "hf_abcdefghijkl", "nested": {"api_key": 1, "n": [1, "sk-abcdefghijk"]}})
        {'lr': 0.1, 'nested': {'n': [1, '<dropped>']}}
    """
    if depth > 8:
        return repr(value)
    if isinstance(value, Mapping):
        return {str(k): scrub(v, depth + 1) for k, v in value.items() if not is_secret_key(str(k))}
    if isinstance(value, (list, tuple)):
        return [scrub(v, depth + 1) for v in value]
    if isinstance(value, str):
        return "<dropped>" if _SECRET_VALUE.match(value) else value
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    return repr(value)


def _git(cwd: str) -> dict[str, Any]:
    def run(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = run("rev-parse", "HEAD")
    if commit is None:
        return {}
    status = run("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _VERSIONS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _hparams(obj: Any) -> dict[str, Any]:
    hp = getattr(obj, "hparams", None)
    return scrub(dict(hp)) if isinstance(hp, Mapping) else {}


def _trainer_settings(trainer: pl.Trainer) -> dict[str, Any]:
    return scrub({
        "precision": str(trainer.precision),
        "strategy": type(trainer.strategy).__name__,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "gradient_clip_val": trainer.gradient_clip_val,
        "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
        "max_epochs": trainer.max_epochs,
        "max_steps": trainer.max_steps,
        "limit_train_batches": trainer.limit_train_batches,
        "limit_val_batches": trainer.limit_val_batches,
        "log_every_n_steps": getattr(trainer, "log_every_n_steps", None),
    })


def _digest(item: Any, h: Any) -> None:
    if isinstance(item, torch.Tensor):
        h.update(str((tuple(item.shape), str(item.dtype))).encode())
        h.update(item.detach().cpu().contiguous().numpy().tobytes())
    elif isinstance(item, Mapping):
        for k in sorted(item, key=str):
            h.update(str(k).encode())
            _digest(item[k], h)
    elif isinstance(item, (list, tuple)):
        for v in item:
            _digest(v, h)
    elif isinstance(item, np.ndarray):
        h.update(item.tobytes())
    else:
        h.update(repr(item).encode())


def _dataset_fingerprint(loader: Any) -> dict[str, Any] | None:
    """Length of the loader's dataset and a hash of its first items (a map-style dataset is read by index, with
    every RNG restored after, so a random transform cannot shift training); ``None`` when there is no loader."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        return None
    out: dict[str, Any] = {"type": type(dataset).__name__}
    try:
        out["length"] = len(dataset)
    except TypeError:
        return out  # an iterable dataset: reading it would consume it
    h = hashlib.sha256()
    py_state, np_state = random.getstate(), np.random.get_state()
    held = HeldGenerators.capture(("dataset", dataset))  # the dataset's own generators are put back too
    try:
        with torch.random.fork_rng(devices=[]):
            for i in range(min(_FINGERPRINT_ITEMS, out["length"])):
                _digest(dataset[i], h)
        out["sample_sha256"] = h.hexdigest()[:16]
        out["sampled_items"] = min(_FINGERPRINT_ITEMS, out["length"])
    except Exception as err:  # a dataset that cannot be indexed here is described, not fingerprinted
        out["sample_error"] = f"{type(err).__name__}: {err}"
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        held.restore()
    return out


def _first_loader(loaders: Any) -> Any:
    if isinstance(loaders, Mapping):
        return next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders


def run_record(trainer: pl.Trainer) -> dict[str, Any]:
    """Everything ``diag/run.json`` holds for this trainer: no environment variable but ``PL_GLOBAL_SEED``, no
    secret-looking key of the hyperparameters (:func:`scrub`), the command line redacted (:func:`redact_command`)."""
    module = trainer.lightning_module
    datamodule = getattr(trainer, "datamodule", None)
    data: dict[str, Any] = {}
    for split, name in (("train", "train_dataloader"), ("val", "val_dataloaders")):
        loaders = getattr(trainer, name, None)  # set once the loops have set up their data
        found = _dataset_fingerprint(_first_loader(loaders)) if loaders is not None else None
        if found is not None:
            data[split] = found
    seed = os.environ.get("PL_GLOBAL_SEED")  # set by Lightning's seed_everything; the only variable read
    device = str(module.device)
    if module.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(module.device)})"
    return {
        "git": _git(os.getcwd()),
        "versions": _versions(),
        "command": redact_command(sys.argv),
        "hyperparameters": _hparams(module),
        "datamodule_hyperparameters": _hparams(datamodule) if datamodule is not None else {},
        "module": type(module).__name__,
        "trainer": _trainer_settings(trainer),
        "seed": int(seed) if seed is not None and seed.lstrip("-").isdigit() else None,
        "data": data,
        "device": device,
        "platform": platform.platform(),
    }


def write_run_record(trainer: pl.Trainer, diag_dir: str) -> str | None:
    """Write ``<diag_dir>/run.json`` (rank zero calls this); never raises.

    Returns:
        A message when the record could not be built; a failure to write the file is reported by
        :func:`~lightning_diag.core.files.write_text` (once per path) and returns ``None``.
    """
    try:
        text = json.dumps(run_record(trainer), indent=2, sort_keys=True, default=repr)
    except Exception as err:  # provenance must never stop a run
        return f"diag/{RUN_FILE} not written: {type(err).__name__}: {err}"
    write_text(os.path.join(diag_dir, RUN_FILE), text)
    return None
