"""Checkpoints: safetensors files in `checkpoints/step_NNNNNN/`, written atomically and durably,
each with a SHA-256 manifest that loading checks.

A checkpoint holds everything a resumed run needs to continue bit for bit:

- `model.safetensors`: the model's parameters (tied weights handled by `save_model`);
- `trainer.safetensors`: AdamW's state tensors, the torch RNG states (stochastic rounding draws
  from them), and in its metadata the step, the optimizer's param groups, the loop's own state
  (the loss summed since the last metrics row) and the fields that define the run
  (`config.identity`), so that one run's checkpoint is never continued as another's;
- `manifest.json`: the size and SHA-256 of each of the two files.

The learning rate is a function of the step and batches are a function of (seed, step), so the
schedule and the data loader need no state of their own.

Crash safety: a checkpoint is written into `step_N.tmp/`, every file fsynced, the manifest last,
the folder fsynced, then renamed to `step_N/` and the parent fsynced. A crash at any instant
leaves the previous checkpoints intact and at most a `.tmp` folder, which is never a candidate
and is removed by the next save. Loading recomputes every hash before reading a tensor, so a
flipped bit or a truncated file is reported as corruption, and a checkpoint whose files are
intact but do not fit the model is reported as a mismatch (never as "delete it").
Checkpoints written before manifests existed load without the check.

Folders sort by step number, not by name: `step_1000000` comes after `step_999999`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

from blockscale.train import files
from blockscale.train.errors import UsageError

MANIFEST = "manifest.json"
_ADVICE = "delete that folder to resume from the checkpoint before it"
FILES = ("model.safetensors", "trainer.safetensors")
_STEP_DIR = re.compile(r"step_(\d+)")


def step_of(path: Path) -> int:
    return int(_STEP_DIR.fullmatch(path.name).group(1))  # type: ignore[union-attr]


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest (lowest step) first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    # A `step_N.tmp` folder is a checkpoint whose writing was cut short: never a candidate.
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=step_of)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest(folder: Path) -> dict:
    return {
        "files": {
            name: {"bytes": (folder / name).stat().st_size, "sha256": sha256(folder / name)}
            for name in FILES
        }
    }


def verify(path: Path) -> bool:
    """Check every file of a checkpoint against its manifest; raises UsageError naming the
    first that differs. False when the checkpoint predates manifests (nothing to check)."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return False
    try:
        listed = json.loads(manifest_path.read_text())["files"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"checkpoint {path} is corrupt: its {MANIFEST} is unreadable ({e}); {_ADVICE}"
        ) from None
    for name in FILES:
        file, want = path / name, listed.get(name, {})
        if not file.is_file():
            raise UsageError(f"checkpoint {path} is incomplete: {name} is missing; {_ADVICE}")
        size = file.stat().st_size
        if size != want.get("bytes"):
            raise UsageError(
                f"checkpoint {path} is corrupt: {name} has {size} bytes, its manifest "
                f"says {want.get('bytes')}; {_ADVICE}"
            )
        if sha256(file) != want.get("sha256"):
            raise UsageError(
                f"checkpoint {path} is corrupt: the SHA-256 of {name} differs from its "
                f"manifest; {_ADVICE}"
            )
    return True


def save(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer,
    meta: dict,
    keep: int,
    run: dict | None = None,
) -> Path:
    """Write the checkpoint of `step` and prune all but the `keep` newest (0: keep all).
    `run`: the fields that define the run (`config.identity`), checked by `load`."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    state = optimizer.state_dict()
    tensors = {
        f"optim.{idx}.{name}": value.detach().cpu().contiguous()
        for idx, entry in state["state"].items()
        for name, value in entry.items()
    }
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    metadata = {
        "step": str(step),
        "param_groups": json.dumps(state["param_groups"]),
        "meta": json.dumps(meta),
    }
    if run is not None:
        metadata["run"] = json.dumps(run, sort_keys=True)
    save_file(tensors, str(tmp / "trainer.safetensors"), metadata=metadata)
    for name in FILES:
        files.fsync_file(tmp / name)
    # The manifest last: a folder with a manifest has both files whole.
    files.write_bytes(tmp / MANIFEST, (json.dumps(_manifest(tmp), indent=2) + "\n").encode())
    files.fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    files.fsync_dir(root)
    for stale in root.glob("step_*.tmp"):  # cut short by an earlier crash
        shutil.rmtree(stale, ignore_errors=True)
    for old in checkpoint_dirs(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _corrupt(path: Path, error: Exception, verified: bool) -> UsageError:
    if verified:  # the bytes are the ones written: the model or the code differs, not the file
        return UsageError(f"checkpoint {path} does not fit this model or version ({error})")
    return UsageError(f"checkpoint {path} is corrupt or incomplete ({error}); {_ADVICE}")


def load_weights(path: Path, model: torch.nn.Module, verified: bool | None = None) -> None:
    """Load the model's parameters (checking the manifest first unless `verified` says so)."""
    if verified is None:
        verified = verify(path)
    try:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise _corrupt(path, e, verified) from None
    if missing or unexpected:
        raise UsageError(
            f"checkpoint {path} does not fit this model (missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )


def run_identity(path: Path) -> dict | None:
    """The fields that define the run that wrote the checkpoint (None: it predates them)."""
    try:
        with safe_open(str(path / "trainer.safetensors"), "pt") as f:
            recorded = f.metadata().get("run")
    except (SafetensorError, OSError) as e:
        raise _corrupt(path, e, False) from None
    return json.loads(recorded) if recorded else None


def check_run(path: Path, run: dict) -> None:
    """Refuse a checkpoint that another run wrote: one whose recorded defining fields differ
    from `run` (`config.identity` of this run), each difference named."""
    recorded = run_identity(path)
    if recorded is not None and recorded != run:
        diffs = [
            f"{k}: {recorded.get(k)!r} there, {run.get(k)!r} now"
            for k in sorted(set(run) | set(recorded))
            if recorded.get(k) != run.get(k)
        ]
        raise UsageError(f"checkpoint {path} was written by another run ({'; '.join(diffs)})")


def load(
    path: Path, model: torch.nn.Module, optimizer, run: dict | None = None
) -> tuple[int, dict]:
    """Restore model, optimizer and RNG states; returns (step, meta). With `run`, refuse a
    checkpoint that another run wrote (one whose recorded defining fields differ)."""
    verified = verify(path)
    if run is not None:
        check_run(path, run)
    load_weights(path, model, verified)
    file = path / "trainer.safetensors"
    try:
        tensors = load_file(str(file))
        with safe_open(str(file), "pt") as f:
            metadata = f.metadata()
        step = int(metadata["step"])
        groups = json.loads(metadata["param_groups"])
        meta = json.loads(metadata["meta"])
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise _corrupt(path, e, verified) from None
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as e:
        raise _corrupt(path, e, verified) from None
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return step, meta
