"""What the entry scripts (train.py, eval.py, ...) share around Hydra: a mistake on the command line or in the
config is reported as one message naming the fix, without a traceback (exit 2); a bug keeps its traceback.

- `entry(main)`: runs a `@hydra.main` function with Hydra re-raising its errors (HYDRA_FULL_ERROR=1) so they
  can be said here: a misspelled key gets the nearest existing key, not Hydra's advice to add it with `+`.
- `UserError`: what a task function raises for a problem the user can fix (a bad setting, a missing or
  damaged file, an unreachable store, a batch that cannot fit), already said in full by its message.
"""

from __future__ import annotations

import difflib
import os
import pickle
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def register() -> None:
    """Make conf/ composable: t6's resolvers (t6.config), the uptrain recipe's (t6.uptrain.recipe), and each
    mechanism's options in Hydra's ConfigStore (which imports every mechanism's file). Every entry script calls it
    once before Hydra composes; calling it again changes nothing."""
    from t6.config import register_resolvers, store_attention_options
    from t6.uptrain.recipe import register_resolvers as register_uptrain_resolvers

    register_resolvers()
    register_uptrain_resolvers()
    store_attention_options()


class UserError(Exception):
    """A problem with what the user asked for; its message says what and how to fix it."""


# What checking a request raises for a problem the user can fix: a setting, a missing or damaged file, an
# unreachable store, a batch that cannot fit. Raised anywhere else, the same types are bugs (a traceback).
USER_ERRORS = (ValueError, FileNotFoundError, ConnectionError, MemoryError, pickle.UnpicklingError)


@contextmanager
def user_errors() -> Iterator[None]:
    """Around the checks of a request (a run's plan, a script's inputs): an error of USER_ERRORS raised there is
    the user's, said by `entry` as one message without a traceback."""
    from t6.data.shards import ShardError

    try:
        yield
    except (*USER_ERRORS, ShardError) as err:
        raise UserError(str(err)) from err


def entry(main: Callable[[], object]) -> None:
    """Call a @hydra.main function; Hydra's composition errors and UserErrors are printed, exit code 2."""
    from hydra.errors import ConfigCompositionException

    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra raises instead of printing its own advice
    try:
        main()
    except ConfigCompositionException as err:
        sys.stderr.write(f"error: {composition_message(err)}\n")
        sys.exit(2)
    except UserError as err:
        sys.stderr.write(f"error: {err}\n")
        sys.exit(2)


def composition_message(err: Exception) -> str:
    """Hydra's composition error in the config's own words: an override of a key the config does not have
    names the nearest keys that it has (Hydra's advice, appending the key with `+`, would only move the
    error into the component that receives it)."""
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
    return text.replace("\n", " ")


HYDRA_ONLY = {".hydra", "train.log", "eval.log"}  # what Hydra writes into a run directory by itself


def discard_unused_run_dir(run_dir: str | Path) -> bool:
    """Remove a run directory holding nothing but what Hydra wrote at start (its .hydra/ and the log):
    the trace of a run that failed on its config before doing anything. Returns whether it did."""
    path = Path(run_dir)
    if not path.is_dir() or not {p.name for p in path.iterdir()} <= HYDRA_ONLY:
        return False
    shutil.rmtree(path)
    return True


def print_config_tree(cfg: DictConfig) -> None:
    """The composed config as a tree (print_config=true; it is always in the run's .hydra/ and MLflow)."""
    import rich
    import rich.syntax
    import rich.tree

    tree = rich.tree.Tree("CONFIG", guide_style="dim")
    for key, value in cfg.items():
        branch = tree.add(str(key))
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        branch.add(rich.syntax.Syntax(text, "yaml"))
    rich.print(tree)
