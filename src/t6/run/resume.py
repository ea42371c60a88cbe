"""Which checkpoint a run resumes from: `ckpt_path=PATH`, `ckpt_path=last`, or this run directory's
last.ckpt (auto_resume)."""

from __future__ import annotations

from pathlib import Path

from t6.model.load import HF_CONFIG


def checkpoint_dir(cfg) -> Path:
    """Where this run's ModelCheckpoint writes (the run directory's checkpoints/ by default)."""
    ckpt_cb = (cfg.get("callbacks") or {}).get("model_checkpoint")
    if ckpt_cb and ckpt_cb.get("dirpath"):
        return Path(ckpt_cb.dirpath)
    return Path(cfg.paths.output_dir) / "checkpoints"


def resolve_ckpt_path(cfg) -> str | None:
    """The checkpoint to resume from: `ckpt_path=PATH`; `ckpt_path=last` (this run directory's
    last.ckpt, which must exist); or, with `auto_resume=true` and no ckpt_path, last.ckpt when
    the run directory already has one (a re-run or requeued job with a fixed run dir)."""
    requested = cfg.get("ckpt_path")
    last = checkpoint_dir(cfg) / "last.ckpt"
    for path in (last, Path(requested) if requested and requested != "last" else None):
        if path is not None and path.is_dir() and not (path / HF_CONFIG).is_file():  # an export: the plan names it
            raise ValueError(
                f"{path} is a directory (a sharded FSDP checkpoint, state_dict_type=sharded): T6 Lab resumes from "
                "single-file checkpoints; train with trainer.strategy.state_dict_type=full, or give ckpt_path= a "
                "checkpoint file"
            )
    if requested == "last":
        if not last.is_file():
            raise FileNotFoundError(
                f"ckpt_path=last: {last} does not exist; point hydra.run.dir (or hydra.sweep.dir) at the "
                "interrupted run's directory, or give ckpt_path=/path/to/file.ckpt"
            )
        return str(last)
    if requested:
        if not Path(requested).exists():  # a directory is read (and refused, naming init_from=) by the plan
            raise FileNotFoundError(
                f"ckpt_path={requested!r} does not exist; give a checkpoint file (e.g. "
                "logs/train/runs/<time>/checkpoints/last.ckpt), or ckpt_path=last for this run directory's"
            )
        return str(requested)
    if cfg.get("auto_resume", False) and last.is_file():
        return str(last)
    return None
