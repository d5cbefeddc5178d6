"""The run's output folder: one live run at a time, never reused by accident, never deleting
what another run wrote, and claimed only once the run's inputs are known to be good.

A run holds its folder through an `OutputFolder`, from the start to its exit:
- `OutputFolder(cfg)`, before anything is loaded, takes the folder's lock (`.megatrain.lock`,
  created with the folder if need be) and applies `check_output_dir`'s rules; it writes nothing
  else. A second run is refused, naming the holder's pid and host (written into the lock file);
- `claim()`, once the run has validated its inputs (tokenizer, data, model config, memory and
  disk plans), makes the folder the run's: the previous run moved aside (overwrite), then
  config.yaml written. A start that fails before it leaves the folder as it found it (one it
  created is removed again; an existing one gets its lock file back as it was, or none);
- `release()` (or the process's exit) lets the lock go.

The lock is an OS file lock (`flock`): the kernel drops it when its process exits or dies, so a
crashed run leaves no stale lock, and on NFS the client forwards it to the server as a
byte-range lock, so it holds across the nodes that share the folder. Several ranks of one job
(torchrun): rank 0 alone opens, claims and holds the folder; the other ranks never touch the
lock. A file system that refuses locks gets a warning and runs unlocked.

The rules (`check_output_dir`):
- a new run (`checkpoint.resume_from: null`) in a non-empty `training.output_dir` is refused,
  with the three ways out: resume it, choose another folder, or `training.overwrite_output_dir`;
- with `overwrite_output_dir: true` the files a run writes there (config.yaml, metrics.jsonl,
  the trackers' tensorboard/, wandb/, swanlog/, checkpoints/, hf_model/) of the previous run
  are moved into `previous-<UTC time>/` inside the folder, never deleted; other files are left
  alone. So metrics.jsonl never mixes two runs and `resume_from: auto` never picks up the old
  run;
- a failed start: a folder whose only run files are a config.yaml MegaTrain wrote, the
  trackers' folders and a metrics.jsonl without a step's record (a start that failed after its
  claim, while loading the weights or in its first step, where a retry of the step may have
  written an event) counts as empty; the new run's config.yaml replaces it, and the trackers'
  folders and the metrics.jsonl are moved into `previous-<UTC time>/`;
- a resumed run continues the folder (its metrics are cut back to the checkpoint's step by
  megatrain.metrics); a non-empty `hf_model/` that is not a MegaTrain export is refused up
  front, not after training, when the export would have to replace it.

`interrupted_message` is the one line printed on Ctrl-C: where the last checkpoint is and how to
resume from it (`resume_hint`, which a run stopped by a non-finite loss prints too).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import IO

from megatrain.checkpoint.export import check_export_target
from megatrain.checkpoint.saving import latest_checkpoint
from megatrain.config import CONFIG_HEADER, TrainConfig, save_config
from megatrain.run_files import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    HF_MODEL_DIR,
    LOCK_FILE,
    METRICS_FILE,
)
from megatrain.trackers import TRACKER_FOLDERS

RUN_FILES = (CONFIG_FILE, METRICS_FILE, *TRACKER_FOLDERS, CHECKPOINTS_DIR, HF_MODEL_DIR)
"""What a run writes at the top of its output_dir (moved aside by overwrite_output_dir)."""
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # a file system without flock
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; str() says where the last checkpoint is and how to resume."""


class OutputFolder:
    """This process's hold on `training.output_dir`: locked and checked from construction,
    the run's from `claim()`, let go by `release()` (or the process's exit)."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.path = out = Path(cfg.training.output_dir)
        _refuse_a_file(out)
        self._created = not out.exists()
        self._claimed = self._released = False
        self._lock_before = _file_state(out / LOCK_FILE)  # put back by an unclaimed release
        self._lock = _lock(out)
        try:
            check_output_dir(
                out,
                resume_from=cfg.checkpoint.resume_from,
                overwrite=cfg.training.overwrite_output_dir,
                export_hf=cfg.checkpoint.export_hf,
            )
        except BaseException:
            self.release()
            raise

    def claim(self) -> str:
        """Make the folder this run's (previous run moved aside, config.yaml written) and
        return a new run id (a resumed run takes its checkpoint's instead)."""
        cfg, out = self.cfg, self.path
        leftovers = _failed_start(out) and any(
            (out / d).exists() for d in (*TRACKER_FOLDERS, METRICS_FILE)
        )
        if cfg.checkpoint.resume_from is None and (cfg.training.overwrite_output_dir or leftovers):
            _move_previous_run(out)  # a failed start's tracker logs too: moved, never deleted
        save_config(cfg, self.path / CONFIG_FILE)
        self._claimed = True
        return uuid.uuid4().hex[:12]

    def release(self) -> None:
        """Let the lock go; a folder this run created and never claimed is removed again."""
        if self._released:
            return
        self._released = True
        if self._created and not self._claimed:
            (self.path / LOCK_FILE).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty: someone else wrote there since
                self.path.rmdir()
        elif not self._claimed and self._lock is not None:  # still held: no one else writes it
            _restore_file(self.path / LOCK_FILE, self._lock_before)
        if self._lock is not None:
            self._lock.close()  # closing the file drops its flock


def check_output_dir(
    output_dir: str | Path, *, resume_from: str | None, overwrite: bool, export_hf: bool
) -> None:
    """Refuse a folder this run may not use (the module docstring's rules); writes nothing."""
    out = Path(output_dir)
    _refuse_a_file(out)
    entries = _entries(out)
    if entries and resume_from is None and not overwrite:
        resume = (
            "Resume the old run with --checkpoint.resume_from auto, choose"
            if latest_checkpoint(out) is not None
            else "It has no checkpoint to resume from: choose"
        )
        raise ValueError(
            f"training.output_dir={str(out)!r} is not empty (it holds "
            f"{_list(entries)}) and checkpoint.resume_from is null, so this would be a new "
            "run on top of an old one: its checkpoints could replace the old ones and "
            f"metrics.jsonl would mix both runs. {resume} another training.output_dir, or set "
            "--training.overwrite_output_dir true to start a new run there (the previous "
            "run's files are moved into a previous-<time>/ folder inside it, never deleted)"
        )
    if export_hf:
        check_export_target(
            out / HF_MODEL_DIR,
            key="the export folder",
            fix="Move or rename it (the end-of-run export replaces only a previous export), "
            "or set checkpoint.export_hf: false",
        )


def interrupted_message(output_dir: str | Path, step: int) -> str:
    """One line for Ctrl-C: where the last checkpoint is and the resume key."""
    return f"interrupted at step {step}; {resume_hint(output_dir)}"


def resume_hint(output_dir: str | Path) -> str:
    """Where a stopped run's last checkpoint is and the key that resumes from it."""
    last = latest_checkpoint(output_dir)
    if last is None:
        return (
            f"no checkpoint was saved yet in {output_dir} (checkpoint.save_every sets how "
            "often): run the same command with --checkpoint.resume_from auto to start it over "
            "in the same folder"
        )
    return (
        f"the last checkpoint is {last}: resume with the same command and "
        "--checkpoint.resume_from auto (or checkpoint.resume_from: auto in the YAML)"
    )


def _refuse_a_file(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"training.output_dir={str(out)!r} is a file, not a folder; choose a folder"
        )


def _entries(out: Path) -> list[str]:
    """What the folder holds that a new run would be put on top of: not the lock, nor a
    failed start's config.yaml."""
    if not out.is_dir():
        return []
    skip = {LOCK_FILE} | (
        {CONFIG_FILE, METRICS_FILE, *TRACKER_FOLDERS} if _failed_start(out) else set()
    )
    return sorted(p.name for p in out.iterdir() if p.name not in skip)


def _failed_start(out: Path) -> bool:
    """Whether the folder holds only what a start that recorded no step leaves: a config.yaml
    that MegaTrain wrote, the folders of trackers opened as training started, and a
    metrics.jsonl of events only (a step's out-of-memory retry, say) if any."""
    present = {name for name in RUN_FILES if (out / name).exists()}
    if METRICS_FILE in present and not _recorded_a_step(out / METRICS_FILE):
        present.discard(METRICS_FILE)
    if CONFIG_FILE not in present or present - {CONFIG_FILE, *TRACKER_FOLDERS}:
        return False
    with open(out / CONFIG_FILE, encoding="utf-8", errors="replace") as f:
        return f.read(len(CONFIG_HEADER)) == CONFIG_HEADER


def _recorded_a_step(metrics: Path) -> bool:
    """Whether metrics.jsonl holds a training step's record (or cannot be read as records)."""
    try:
        with open(metrics, encoding="utf-8") as f:
            return any(json.loads(line).get("kind") == "train" for line in f if line.strip())
    except (OSError, ValueError, AttributeError):
        return True  # not ours to judge: kept as a run's


def _lock(out: Path) -> IO[str] | None:
    """Take the folder's lock (creating the folder if need be) and write the holder into it;
    None on a file system without locks (a warning says so)."""
    path = out / LOCK_FILE
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o666), "r+")
    except OSError as e:
        if e.errno in _NOT_WRITABLE:
            raise _not_writable(out, e) from None
        raise
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise _in_use(out, path) from None
    except OSError as e:
        lock.close()
        if e.errno not in _NO_LOCKS:
            raise
        print(
            f"warning: the file system of training.output_dir={str(out)!r} does not support "
            f"file locks ({e.strerror}): nothing stops a second run from using the folder at "
            "the same time",
            flush=True,
        )
        return None
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": _utc_now()}
    lock.truncate(0)
    lock.write(json.dumps(holder) + "\n")
    lock.flush()
    return lock


def _file_state(path: Path) -> tuple[bytes, int, int] | None:
    """A file's bytes and (access, modification) times in ns; None when it does not exist."""
    try:
        stat = path.stat()
        return path.read_bytes(), stat.st_atime_ns, stat.st_mtime_ns
    except FileNotFoundError:
        return None


def _restore_file(path: Path, state: tuple[bytes, int, int] | None) -> None:
    """Put a file back as `_file_state` found it (removed if it did not exist)."""
    with contextlib.suppress(OSError):  # best effort: the lock goes with the process anyway
        if state is None:
            path.unlink(missing_ok=True)
            return
        data, atime_ns, mtime_ns = state
        path.write_bytes(data)  # the same inode: the flock taken on it stays valid
        os.utime(path, ns=(atime_ns, mtime_ns))


def _in_use(out: Path, path: Path) -> ValueError:
    try:
        holder = json.loads(path.read_text())
        who = f"process {holder['pid']} on host {holder['host']} (since {holder['since']} UTC)"
    except (OSError, ValueError, KeyError, TypeError):  # the holder is still writing it
        who = "another process"
    return ValueError(
        f"training.output_dir={str(out)!r} is in use: {who} holds its lock {path}. Two runs "
        "in one folder would interleave metrics.jsonl and prune each other's checkpoints. Wait "
        "for that run to end or stop it (the lock goes with its process, also when it "
        "crashes), or choose another training.output_dir"
    )


def _not_writable(out: Path, e: OSError) -> ValueError:
    return ValueError(
        f"training.output_dir={str(out)!r} cannot be written ({e.strerror}: {e.filename}): "
        "a run writes its config, metrics, checkpoints and export there. Choose a folder you "
        "can write to with --training.output_dir PATH, or make this one writable"
    )


def _move_previous_run(out: Path) -> None:
    """The run files in `out` into a new previous-<time>/ folder; a failed start's lone
    config.yaml is left for the new run to replace."""
    present = [n for n in RUN_FILES if (out / n).exists()]
    failed = _failed_start(out)
    if not present or (present == [CONFIG_FILE] and failed):
        return
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest, n = out / f"previous-{stamp}", 0
    while dest.exists():
        n += 1
        dest = out / f"previous-{stamp}.{n}"
    dest.mkdir()
    for name in present:
        os.rename(out / name, dest / name)
    whose = "a failed start's" if failed else "training.overwrite_output_dir: the previous run's"
    print(f"{whose} {_list(present)} moved to {dest}")


def _utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())


def _list(names: list[str]) -> str:
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


__all__ = [
    "LOCK_FILE",
    "RUN_FILES",
    "OutputFolder",
    "TrainingInterrupted",
    "check_output_dir",
    "interrupted_message",
    "resume_hint",
]
