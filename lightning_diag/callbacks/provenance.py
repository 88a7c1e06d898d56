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
from collections.abc import Mapping
from importlib import metadata
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from lightning_diag.instrument.rng import HeldGenerators

__all__ = ["RUN_FILE", "is_secret_key", "run_record", "scrub", "write_run_record"]

RUN_FILE = "run.json"
#: Keys dropped wherever they occur: they may hold credentials.
_SECRET_KEY = re.compile(r"(token|secret|passw|pwd|api[_-]?key|apikey|auth|credential|private[_-]?key)", re.I)
#: Values dropped whatever their key: strings shaped like well-known access tokens.
_SECRET_VALUE = re.compile(r"^(hf_|sk-|ghp_|gho_|github_pat_|xox[abpr]-|AKIA)[A-Za-z0-9_\-]{8,}")
_VERSIONS = ("torch", "pytorch-lightning", "lightning", "lightning-diag", "transformers", "numpy")
_FINGERPRINT_ITEMS = 8


def is_secret_key(key: str) -> bool:
    """Whether a key looks like it holds a credential (``hf_token``, ``wandb_api_key``, ``password``)."""
    return bool(_SECRET_KEY.search(key))


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
    """Everything ``diag/run.json`` holds for this trainer (no environment variable, no secret-looking key)."""
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
        "command": scrub(sys.argv[:1] + [a for a in sys.argv[1:] if "=" not in a or not is_secret_key(a)]),
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
    """Write ``<diag_dir>/run.json`` (rank zero calls this); a failure is returned as a message, never raised."""
    try:
        record = run_record(trainer)
        os.makedirs(diag_dir, exist_ok=True)
        with open(os.path.join(diag_dir, RUN_FILE), "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=2, sort_keys=True, default=repr)
    except Exception as err:  # provenance must never stop a run
        return f"diag/{RUN_FILE} not written: {type(err).__name__}: {err}"
    return None
