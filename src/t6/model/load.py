"""Reading checkpoints into a T6: the one loader every script calls.

Two kinds of files hold a T6: a Lightning training checkpoint (`hyper_parameters.model_config`,
`state_dict` with `model.` keys) written by train.py, and a converted warm-start checkpoint
(`format`, `model_config`, `state_dict`) written by convert.py. Both are read with
`torch.load(weights_only=True)`: a file holding pickled code is refused. Every problem (missing,
damaged, not a T6, weights that do not fit the config) is an error naming the config field, the
file and the fix.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from t6.model.config import ModelConfig
from t6.model.t6 import T6

WARM_START_FORMAT = "t6-warm-start-v1"


def read_checkpoint(path, what: str = "ckpt_path", map_location: Any = "cpu", mmap: bool = False) -> dict:
    """torch.load(weights_only=True) of a checkpoint named by the config field `what`; a missing,
    truncated or corrupted file is an error naming the field, the file and the fix."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"{what}={str(path)!r} does not exist (e.g. logs/train/runs/<time>/checkpoints/last.ckpt)"
        )
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # torch/zipfile/unpickler errors of a damaged file have no common type
        if "weights_only" in str(err) and "Unsupported global" in str(err):
            raise pickle.UnpicklingError(
                f"{what}={str(path)!r} holds pickled code, which T6 Lab never loads: {err}"
            ) from None
        raise ValueError(
            f"{what}={str(path)!r} is not a readable checkpoint (truncated or corrupted? {type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}); point {what} at an intact file, e.g. an earlier step*.ckpt "
            "of the same run"
        ) from None
    if not isinstance(ckpt, dict):
        raise ValueError(
            f"{what}={str(path)!r} is not a T6 Lab checkpoint (it holds a {type(ckpt).__name__}, not a dict)"
        )
    return ckpt


def model_state(ckpt: dict, what: str, path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, backbone state dict) of a training or warm-start checkpoint."""
    try:
        if ckpt.get("format") == WARM_START_FORMAT:
            fields, state = ckpt["model_config"], ckpt["state_dict"]
        else:
            fields = ckpt["hyper_parameters"]["model_config"]
            state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"{what}={str(path)!r} is not a T6 checkpoint: it has no {err} "
            "(train.py writes checkpoints/last.ckpt, convert.py a warm-start file)"
        ) from None
    try:
        cfg = ModelConfig(**fields)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what}={str(path)!r}: its model config does not build a T6 here: {err}") from None
    check_weights(state, cfg, f"{what}={path}")
    return cfg, state


def check_weights(state: dict[str, torch.Tensor], cfg: ModelConfig, what: str) -> None:
    """Raise naming every missing, unexpected or mis-shaped tensor when state does not fit cfg."""
    with torch.device("meta"):  # shapes only, no memory
        expected = {k: tuple(v.shape) for k, v in T6(cfg).state_dict().items()}
    problems = [f"missing {k}" for k in expected if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in expected]
    problems += [
        f"{k}: shape {tuple(state[k].shape)}, config says {shape}"
        for k, shape in expected.items()
        if k in state and tuple(state[k].shape) != shape
    ]
    if problems:
        shown = problems[:8] + ([f"... {len(problems) - 8} more"] if len(problems) > 8 else [])
        raise ValueError(
            f"{what}: the weights do not match its model config ({cfg.attention}, n_head={cfg.n_head}, "
            f"d_model={cfg.d_model}, n_layer={cfg.n_layer}):\n  - " + "\n  - ".join(shown)
        )


def build_model(ckpt: dict, what: str, path, device: str | torch.device = "cpu") -> T6:
    """The T6 of an already read checkpoint (training or warm-start), on `device`, in eval mode."""
    cfg, state = model_state(ckpt, what, path)
    model = T6(cfg)
    model.load_state_dict(state)
    return model.to(device).eval()


def load_model(path, *, what: str = "ckpt_path", device: str | torch.device = "cpu") -> T6:
    """The T6 held by a training or warm-start checkpoint, on `device`, in eval mode."""
    return build_model(read_checkpoint(path, what, map_location="cpu", mmap=True), what, path, device)
