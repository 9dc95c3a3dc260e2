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

A write that fails (a full disk) is an `OSError` whichever library wrote: safetensors reports
its own as `SafetensorError` ("I/O error: No space left on device (os error 28)"), which
`_written` turns back into the OSError it wraps, so the training loop says it in one line
(files.write_failure) where it showed a traceback (issue 60).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

from blockscale.train import files
from blockscale.train.errors import UsageError

MANIFEST = "manifest.json"
_ADVICE = "delete that folder to resume from the checkpoint before it"
FILES = ("model.safetensors", "trainer.safetensors")
SHARDED = "fsdp"  # the manifest's "format" of a sharded checkpoint
RANK_FILE = "rank_{}.safetensors"
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


def _manifest(folder: Path, names=FILES) -> dict:
    return {
        "files": {
            name: {"bytes": (folder / name).stat().st_size, "sha256": sha256(folder / name)}
            for name in names
        }
    }


def verify(path: Path) -> bool:
    """Check every file of a checkpoint against its manifest; raises UsageError naming the
    first that differs. False when the checkpoint predates manifests (nothing to check)."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
        listed = manifest["files"]
        # A sharded checkpoint lists its own files (DCP's and one per rank); it needs them all.
        names = sorted(listed) if manifest.get("format") == SHARDED else FILES
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(
            f"checkpoint {path} is corrupt: its {MANIFEST} is unreadable ({e}); {_ADVICE}"
        ) from None
    for name in names:
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


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _written(write, source, path: Path, **kwargs) -> None:
    """`write(source, str(path), **kwargs)` (safetensors' save_file or save_model); its I/O
    failure as the OSError it wraps (module docstring)."""
    try:
        write(source, str(path), **kwargs)
    except SafetensorError as e:
        found = _OS_ERROR.search(str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


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
    _written(save_model, model, tmp / "model.safetensors")
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
    _written(save_file, tensors, tmp / "trainer.safetensors", metadata=metadata)
    for name in FILES:
        files.fsync_file(tmp / name)
    return _publish(tmp, _manifest(tmp), keep)


def _publish(tmp: Path, manifest: dict, keep: int) -> Path:
    """Turn the whole, fsynced files in `tmp` into the checkpoint `step_N/`, then prune."""
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    root = tmp.parent
    # The manifest last: a folder with a manifest has all its files whole.
    files.write_bytes(tmp / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    files.fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    files.fsync_dir(root)
    for stale in root.glob("step_*.tmp"):  # cut short by an earlier crash
        shutil.rmtree(stale, ignore_errors=True)
    for old in checkpoint_dirs(root.parent)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _corrupt(path: Path, error: Exception, verified: bool) -> UsageError:
    if verified:  # the bytes are the ones written: the model or the code differs, not the file
        return UsageError(f"checkpoint {path} does not fit this model or version ({error})")
    return UsageError(f"checkpoint {path} is corrupt or incomplete ({error}); {_ADVICE}")


def load_weights(path: Path, model: torch.nn.Module, verified: bool | None = None) -> None:
    """Load the model's parameters (checking the manifest first unless `verified` says so).
    A sharded checkpoint loads into an unsharded model too (DCP in one process: `eval`)."""
    if verified is None:
        verified = verify(path)
    if is_sharded(path):
        import torch.distributed.checkpoint as dcp

        state = model.state_dict()
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
        except Exception as e:  # DCP wraps every rank's error in its own exception type
            raise _corrupt(path, e, verified) from None
        model.load_state_dict(state)
        return
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
    trainer = RANK_FILE.format(0) if is_sharded(path) else "trainer.safetensors"
    try:
        with safe_open(str(path / trainer), "pt") as f:
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


# --------------------------------------------------------------------------- sharded (--fsdp)
#
# A --fsdp run's checkpoint: the model and AdamW state as torch.distributed.checkpoint (DCP)
# writes them, each rank its own shards (`__R_0.distcp`, `.metadata`), by fully qualified
# parameter name with global shapes and offsets, so they load onto any number of ranks (DCP
# reshards on load). Beside them one `rank_R.safetensors` per rank: its random stream (RNG
# states) and its loop sums; rank 0's also records the step, the fields that define the run and
# the number of ranks. Crash safety as above: every rank writes into `step_N.tmp/`, then after a
# barrier rank 0 fsyncs every file, writes the manifest (every file's size and SHA-256, and
# "format": "fsdp"), renames the folder and prunes.


def is_sharded(path: Path) -> bool:
    """Whether a checkpoint was written by a --fsdp run (DCP shards, not safetensors)."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == SHARDED
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return (path / ".metadata").exists()


def save_sharded(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer,
    meta: dict,
    keep: int,
    run: dict,
    ranks,
    device: torch.device,
) -> Path:
    """Every rank: write the checkpoint of `step` of a sharded model (collective); `meta` is
    this rank's loop state. Returns the checkpoint's folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(run_dir) / "checkpoints"
    tmp = root / f"step_{step:06d}.tmp"

    def start() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    ranks.on_main(start, device)
    model_state, optim_state = get_state_dict(model, optimizer)
    if ranks.expert_parallel:
        _experts_as_shards(model, model_state, optim_state, device)
    if ranks.tensor_parallel:
        _strided_as_shards(model_state, optim_state)
    dcp.save({"model": model_state, "optim": optim_state}, storage_writer=dcp.FileSystemWriter(tmp))
    tensors = {"rng.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    metadata = {"step": str(step), "meta": json.dumps(meta)}
    if ranks.main:
        metadata.update(run=json.dumps(run, sort_keys=True), world_size=str(ranks.world_size))
    own = tmp / RANK_FILE.format(ranks.rank)
    _written(save_file, tensors, own, metadata=metadata)
    files.fsync_file(own)
    ranks.barrier()  # every rank's files are whole before rank 0 lists them

    def publish() -> Path:
        names = sorted(p.name for p in tmp.iterdir() if p.is_file())
        for name in names:  # DCP fsynced its files (sync_files); a clean file costs nothing
            files.fsync_file(tmp / name)
        manifest = {"format": SHARDED, "world_size": ranks.world_size, **_manifest(tmp, names)}
        return _publish(tmp, manifest, keep)

    ranks.on_main(publish, device)
    return tmp.with_name(tmp.name.removesuffix(".tmp"))


def _experts_as_shards(model, model_state: dict, optim_state: dict, device) -> None:
    """An --ep run's state dicts with each rank's expert weights and their AdamW moments as
    DTensors Shard(0) of the whole [E, ...] tensors: DCP then writes every rank's experts under
    their global offsets (plain tensors it takes as replicated, written once), so the files are
    those of a one-process model's whole experts and load onto any ranks, or none (`eval`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from blockscale.train.ranks import local_experts

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for name, param in local_experts(model).items():
        model_state[name] = DTensor.from_local(model_state[name], mesh, [Shard(0)], run_check=False)
        # A copy: get_state_dict hands out the optimizer's own per-parameter dicts.
        moments = optim_state["state"][name] = dict(optim_state["state"].get(name, {}))
        for key, value in list(moments.items()):
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                moments[key] = DTensor.from_local(value, mesh, [Shard(0)], run_check=False)


def _experts_as_local(model_state: dict, optim_state: dict) -> None:
    """Undo `_experts_as_shards` after DCP loaded into the shards: the plain local tensors."""
    from torch.distributed.tensor import DTensor

    for states in (model_state, *optim_state["state"].values()):
        for key, value in states.items():
            if isinstance(value, DTensor):
                states[key] = value.to_local()


def _strided_states(model_state: dict, optim_state: dict) -> list[tuple[dict, str]]:
    """(dict, key) of every DTensor in a pair of state dicts whose layout DCP cannot write: a
    --tp run's stacked projections (`_StridedShard`: each rank holds several row ranges of the
    whole tensor, and DCP stores one box per rank). The optimizer's per-parameter dicts are
    copied first (get_state_dict hands out the optimizer's own)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    def strided(value) -> bool:
        return isinstance(value, DTensor) and any(
            isinstance(p, _StridedShard) for p in value.placements
        )

    found = [(model_state, key) for key, value in model_state.items() if strided(value)]
    for name, moments in list(optim_state["state"].items()):
        if any(strided(v) for v in moments.values()):
            moments = optim_state["state"][name] = dict(moments)
            found += [(moments, key) for key, value in moments.items() if strided(value)]
    return found


def _strided_as_shards(model_state: dict, optim_state: dict) -> list[tuple[dict, str, tuple]]:
    """A --tp run's state dicts with each `_StridedShard` DTensor redistributed to Shard(0)
    of the same whole value (an all-gather of that tensor, then each rank keeps its rows), so
    DCP writes the one-device tensor in contiguous pieces: the files load onto any ranks, or
    none (`eval`). Returns what `_strided_as_local` needs to undo it after a load."""
    from torch.distributed.tensor import Shard

    undo = []
    for states, key in _strided_states(model_state, optim_state):
        undo.append((states, key, states[key].placements))
        _relayout(states, key, [Shard(0)])
    return undo


def _strided_as_local(undo: list[tuple[dict, str, tuple]]) -> None:
    """Undo `_strided_as_shards` after DCP loaded into the Shard(0) pieces (in place): the
    values back in their `_StridedShard` layouts, which set_state_dict copies into the model."""
    for states, key, placements in undo:
        _relayout(states, key, placements)


def _relayout(states: dict, key: str, placements) -> None:
    """states[key], a DTensor, with the same whole value in `placements` (Shard(0) or its
    `_StridedShard` layout), rebuilt from the whole tensor (an all-gather, then each rank
    keeps its part). The strided side is tp.py's own code, never DTensor's: torch 2.11's
    DTensor cannot gather or place a `_StridedShard` on a 1-D mesh."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from blockscale.distributed.tp import stacked_from_full, stacked_full_tensor

    value = states[key]
    mesh = value.device_mesh
    if list(placements) == [Shard(0)]:
        states[key] = distribute_tensor(
            stacked_full_tensor(value), mesh, placements, src_data_rank=None
        )
    else:
        states[key] = stacked_from_full(value.full_tensor(), mesh, placements)


def _rank_files(path: Path, verified: bool) -> list[tuple[dict, str]]:
    """(metadata, file name) of every rank that wrote the checkpoint, rank 0 first."""
    try:
        with safe_open(str(path / RANK_FILE.format(0)), "pt") as f:
            world = int(f.metadata()["world_size"])
        found = []
        for r in range(world):
            with safe_open(str(path / RANK_FILE.format(r)), "pt") as f:
                found.append((f.metadata(), RANK_FILE.format(r)))
        return found
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise _corrupt(path, e, verified) from None


def load_sharded(
    path: Path,
    model: torch.nn.Module,
    optimizer,
    run: dict,
    ranks,
    device: torch.device,
    seed: int,
) -> tuple[int, list[dict]]:
    """Every rank: restore a sharded model and its optimizer from a sharded checkpoint, written
    on any number of ranks, and this rank's random stream (a rank the checkpoint has none for
    is seeded from (seed, rank, step)). Returns (step, the loop state of every rank that wrote
    it, rank 0 first)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from blockscale.train.ranks import seed_stream

    def check() -> bool:
        verified = verify(path)
        check_run(path, run)
        return verified

    verified = ranks.on_main(check, device)
    written = _rank_files(path, verified)
    step = int(written[0][0]["step"])
    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        if ranks.expert_parallel:
            _experts_as_shards(model, model_state, optim_state, device)
        if ranks.tensor_parallel:
            undo = _strided_as_shards(model_state, optim_state)
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
        if ranks.expert_parallel:
            _experts_as_local(model_state, optim_state)
        if ranks.tensor_parallel:
            _strided_as_local(undo)
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    except Exception as e:  # DCP wraps every rank's error in its own exception type
        raise _corrupt(path, e, verified) from None
    # Under --tp every rank's stream is rank 0's (they draw alike): any number of ranks takes it.
    own = 0 if ranks.tensor_parallel else ranks.rank
    if own < len(written):
        rng = load_file(str(path / written[own][1]))
        torch.set_rng_state(rng["rng.cpu"])
        if "rng.cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["rng.cuda"], device)
    else:
        seed_stream(seed, ranks.rank, step)
    return step, [json.loads(m["meta"]) for m, _ in written]
