"""Which checkpoint a run resumes from: `ckpt_path=PATH`, or this run directory's newest whole checkpoint
(`ckpt_path=last`, or `auto_resume` when the directory has one).

A run directory holds `last.ckpt` and the newest periodic `step*.ckpt` files. A crash between a periodic save and
the `last.ckpt` beside it, or a disk that fills while `last.ckpt` is written, leaves a periodic file newer than
`last.ckpt` (or none at all); every write is atomic, but a file copied or cut short outside the run is not. So the
resume point is the newest of them that reads whole: `last.ckpt`, or a `step*.ckpt` that is newer, or the only one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from t6.errors import MissingFile, SettingError
from t6.model.load import HF_CONFIG, read_checkpoint
from t6.run.sections import Component

LAST = "last.ckpt"
TEMPORARY = (".*.tmp", "*.link")  # a write or a link a killed process left (t6.training.checkpoint_io)


def checkpoint_dir(output_dir: str | Path, checkpoints: Component | None) -> Path:
    """Where this run's checkpoints go: the checkpoint callback's dirpath (`checkpoints`: its Component), else the
    run directory's checkpoints/."""
    if checkpoints is not None and checkpoints.arguments.get("dirpath"):
        return Path(checkpoints.arguments["dirpath"])
    return Path(output_dir) / "checkpoints"


@dataclass(frozen=True)
class Found:
    """The checkpoint to resume from (None: none), its contents as read (mapped, not loaded), how it was chosen,
    and the files passed over with why."""

    path: str | None
    ckpt: dict | None
    how: str
    passed_over: tuple[str, ...] = field(default=())


def newest_whole_checkpoint(folder: Path) -> Found:
    """Of `folder`'s last.ckpt and step*.ckpt, the one with the highest step that reads whole (last.ckpt first at
    equal steps); a file that does not read (cut short, damaged) is passed over, named with its error."""
    candidates = [folder / LAST] + sorted(p for p in folder.glob("step*.ckpt") if p.name != LAST)
    best: tuple[int, Path, dict] | None = None
    passed = []
    for path in (p for p in candidates if p.is_file()):
        try:
            ckpt = read_checkpoint(path, "ckpt_path", mmap=True)
            step = int(ckpt.get("global_step", 0))
        except (ValueError, OSError) as err:
            detail = re.search(r"\? (.*?)\); point", str(err))  # read_checkpoint's words for the damage
            passed.append(f"{path.name} does not read whole ({detail[1] if detail else str(err)[:200]})")
            continue
        if best is None or step > best[0]:
            best = (step, path, ckpt)
    if best is None:
        return Found(None, None, "", tuple(passed))
    step, path, ckpt = best
    how = "the run directory's newest whole checkpoint" + ("" if path.name == LAST else f" ({path.name})")
    return Found(str(path), ckpt, how, tuple(passed))


def find_resume(requested: str | None, auto_resume: bool, folder: Path) -> Found:
    """The checkpoint to resume from: `ckpt_path=PATH` (`requested`); `ckpt_path=last` (the newest whole checkpoint
    in `folder`, the run's checkpoint folder, which must exist); or, with `auto_resume` and no ckpt_path, the newest
    whole checkpoint in `folder` when it has one (a re-run or requeued job with a fixed run dir)."""
    for path in (folder / LAST, Path(requested) if requested and requested != "last" else None):
        if path is not None and path.is_dir() and not (path / HF_CONFIG).is_file():  # an export: the plan names it
            raise SettingError(
                f"{path} is a directory (a sharded FSDP checkpoint, state_dict_type=sharded): T6 Lab resumes from "
                "single-file checkpoints; train with trainer.strategy.state_dict_type=full, or give ckpt_path= a "
                "checkpoint file"
            )
    if requested and requested != "last":
        if not Path(requested).exists():  # a directory is read (and refused, naming init_from=) by the plan
            raise MissingFile(
                f"ckpt_path={requested!r} does not exist; give a checkpoint file (e.g. "
                "logs/train/runs/<time>/checkpoints/last.ckpt), or ckpt_path=last for this run directory's"
            )
        return Found(str(requested), read_checkpoint(requested, "ckpt_path", mmap=True), f"ckpt_path={requested}")
    if requested != "last" and not auto_resume:
        return Found(None, None, "")
    found = newest_whole_checkpoint(folder) if folder.is_dir() else Found(None, None, "")
    if requested == "last" and found.path is None:
        passed = f" ({'; '.join(found.passed_over)})" if found.passed_over else ""
        raise MissingFile(
            f"ckpt_path=last: {folder} holds no whole checkpoint{passed}; point hydra.run.dir (or hydra.sweep.dir) "
            "at the interrupted run's directory, or give ckpt_path=/path/to/file.ckpt"
        )
    how = f"ckpt_path=last: {found.how}" if requested == "last" else f"auto_resume: {found.how}"
    return Found(found.path, found.ckpt, how if found.path else "", found.passed_over)
