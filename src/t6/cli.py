"""The command line's one boundary: what every entry script runs around its work. Each script has this shape:

    @hydra.main(version_base="1.3", config_path="conf", config_name="train")
    def main(cfg: DictConfig):
        return t6.run.train.main(cfg)   # one function of src/t6 does the work and prints its result

    if __name__ == "__main__":
        entry(main)

`entry(main)`:

1. prepares the process: `T6_ROOT` (the project: the script's folder, unless set), no tqdm bars where stderr is
   not a terminal (`quiet_progress_bars`, before anything imports tqdm), the libraries' messages that say nothing
   about a T6 run dropped (`quiet_libraries`), t6's resolvers and each mechanism's options registered for Hydra
   (`register`);
2. runs `main`, Hydra re-raising its errors (HYDRA_FULL_ERROR=1) so they are said here;
3. says a user's mistake as one message, without a traceback, and exits with code 2: the project's own errors
   (t6.errors.UserError, raised on purpose where a script checks what it was asked for), Hydra's composition
   errors (a misspelled key gets the nearest keys the config has), and a file this process may not write
   (permission, a read-only or full disk, a file-size limit: Hydra's own run directory included). Anything else
   is a bug, a ValueError too: it keeps its traceback (exit 1).
"""

from __future__ import annotations

import difflib
import errno
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from t6.errors import UserError, UserExit

USER_EXIT = 2  # a mistake the user can fix, said in one message


def entry(main: Callable[[], object]) -> None:
    """Run an entry script's `main` (its @hydra.main function, or report.py's) inside the boundary above."""
    script = Path(getattr(main, "__wrapped__", main).__code__.co_filename).resolve()
    os.environ.setdefault("T6_ROOT", str(script.parent))
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    quiet_progress_bars()
    quiet_libraries()
    register()
    try:
        main()
    except UserExit as exit_:
        say(str(exit_.error))
    except Exception as err:
        message = user_message(err)
        if message is None:
            raise  # a bug: its traceback
        say(message)


def say(message: str) -> None:
    """A user's mistake: one message, exit 2."""
    sys.stderr.write(f"error: {message}\n")
    sys.exit(USER_EXIT)


def user_message(err: Exception) -> str | None:
    """What to tell the user about `err` (see the module docstring), None for a bug."""
    from hydra.errors import ConfigCompositionException, InstantiationException

    if isinstance(err, InstantiationException) and isinstance(err.__cause__, UserError):
        err = err.__cause__  # a component's own check, raised as Hydra built it
    if isinstance(err, UserError):
        return str(err)
    resolved = resolver_message(err)
    if resolved is not None:
        return resolved
    if isinstance(err, ConfigCompositionException):  # before OSError: Hydra's missing config is an IOError too
        return composition_message(err)
    if isinstance(err, OSError) and err.errno in UNWRITABLE and err.filename:
        return unwritable_message(err)
    return None


def register() -> None:
    """Make conf/ composable: t6's resolvers (t6.hydra_config), the uptrain recipe's (t6.uptrain.recipe), and each
    mechanism's options in Hydra's ConfigStore (which imports every mechanism's file). `entry` calls it before
    Hydra composes (tests call it once); calling it again changes nothing."""
    from t6.hydra_config import register_resolvers, store_attention_options
    from t6.uptrain.recipe import register_resolvers as register_uptrain_resolvers

    register_resolvers()
    register_uptrain_resolvers()
    store_attention_options()


# A file the process may not write: no permission, a read-only file system, no room (the disk, the quota, the
# process's file-size limit).
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def unwritable_message(err: OSError) -> str:
    """A file this process may not write, with the fix (an OSError whose text the project wrote says its own)."""
    if err.strerror != os.strerror(err.errno):
        return f"cannot write {err.filename}: {err.strerror}"
    if err.errno == errno.EFBIG:
        return (
            f"cannot write {err.filename}: {err.strerror}; this process may write no file larger than its file-size "
            "limit (`ulimit -f`): raise it (ulimit -f unlimited) or write smaller files"
        )
    return (
        f"cannot write {err.filename}: {err.strerror}; give a directory this process may write and that has room "
        "(hydra.run.dir=..., paths.root_dir=..., or the file's own setting)"
    )


def resolver_message(err: Exception) -> str | None:
    """A UserError a resolver of t6's raised while OmegaConf resolved an interpolation (`${t6.attentions:...}`,
    the uptrain recipe's): OmegaConf re-raises it as an InterpolationResolutionError that keeps only its type's
    name and message, "SettingError raised while resolving interpolation: ...". None for anything else."""
    from omegaconf.errors import InterpolationResolutionError

    if not isinstance(err, InterpolationResolutionError):
        return None
    found = re.match(r"(\w+) raised while resolving interpolation: (.*)", str(err), re.S)
    if found is None or found.group(1) not in user_error_names(UserError):
        return None
    return f"{err.full_key}: {found.group(2).splitlines()[0]}" if err.full_key else found.group(2).splitlines()[0]


def user_error_names(cls: type) -> set[str]:
    """The names of `cls` and its subclasses (those defined by the modules imported so far)."""
    return {cls.__name__}.union(*(user_error_names(sub) for sub in cls.__subclasses__()))


def composition_message(err: Exception) -> str:
    """Hydra's composition error in the config's own words: an override of a key the config does not have
    names the nearest keys that it has (Hydra's advice, appending the key with `+`, would only move the
    error into the component that receives it)."""
    from omegaconf import DictConfig

    text = str(err)
    missing = re.match(r"Could not override '([^']+)'", text)
    cause = err.__cause__
    parent = getattr(cause, "parent_node", None)
    if missing and isinstance(parent, DictConfig):
        key = missing.group(1)
        prefix, _, leaf = key.rpartition(".")
        close = difflib.get_close_matches(leaf, [str(k) for k in parent.keys()], n=3)
        if close:
            names = " or ".join(f"{prefix}.{c}" if prefix else c for c in close)
            return f"{key} is not a setting; did you mean {names}?"
        keys = ", ".join(sorted(str(k) for k in parent.keys()))
        return f"{key} is not a setting; {prefix or 'the config'} has: {keys}"
    if missing and "No match in the defaults list" in text:  # a group of conf/ this script's config does not take
        key = missing.group(1)
        model = (
            "; the model (its attention and size) of eval.py, generate.py, export.py and convert.py comes from the "
            "checkpoint they read (ckpt_path=...)"
            if key in MODEL_GROUPS
            else ""
        )
        return f"{key}= is not a setting of this script (its --help lists them){model}"
    return text.replace("\n", " ")


MODEL_GROUPS = ("attention", "size")  # train.py's groups that make the model


# Library messages that say nothing about a T6 run, dropped one by one at the logger that emits them (a filter on
# exact message beginnings, never a whole logger, level or warning class):
# - Lightning: the LitLogger advertisement; "Trainer already configured with model summary callbacks"
#   (conf/callbacks/default.yaml chooses the rich summary on purpose); "`Trainer(limit_val_batches=1.0)` was
#   configured" (the config states Lightning's default explicitly);
# - lm-eval: "Overwriting default num_fewshot" (the eval group sets num_fewshot on purpose);
# - torch: the `LeafSpec` deprecation that Lightning 2.6's own `_pytree` triggers on every run.
DROPPED = {
    "lightning.pytorch.utilities.rank_zero": (
        "💡 Tip: For seamless cloud logging",
        "Trainer already configured with model summary callbacks",
        "`Trainer(limit_val_batches=1.0)` was configured",
    ),
    "lightning.fabric.utilities.rank_zero": ("💡 Tip: For seamless cloud logging",),
    "lm_eval.evaluator": ("Overwriting default num_fewshot of",),
}


class DropMessages(logging.Filter):
    def __init__(self, beginnings: tuple[str, ...]):
        super().__init__()
        self.beginnings = beginnings

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.beginnings)


def quiet_libraries() -> None:
    """Install the filters of DROPPED (idempotent)."""
    for name, beginnings in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(beginnings))
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", module="lightning")


def quiet_progress_bars() -> None:
    """Where stderr is not a terminal (nohup, SLURM logs, CI), no tqdm progress bar in the process (lm-eval draws
    several per evaluation, each redrawn line of which would stay in the log file): TQDM_DISABLE, which tqdm reads
    when it is imported, so this comes first. A TQDM_DISABLE already set is kept."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
