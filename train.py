"""Train a T6: `python train.py attention=tpa size=tiny` (see conf/train.yaml for every group)."""

import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("T6_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import t6.config  # noqa: E402,F401  (registers the config resolvers)
from t6.hardware.probes import env_rank  # noqa: E402
from t6.run.launch import hydra_job_scope  # noqa: E402
from t6.run.train import discard_unused_run_dir, summary, train  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        with hydra_job_scope():  # DDP ranks started by Lightning repeat this job, not the whole sweep
            metrics, objects = train(cfg)
    except Exception:  # failed on its config before writing anything: no empty run folder left behind
        if env_rank() == 0:
            discard_unused_run_dir(HydraConfig.get().runtime.output_dir)
        raise
    except SIGTERMException as stop:  # SIGTERM or Ctrl-C: last.ckpt saved, the MLflow run marked KILLED
        signum = getattr(stop, "signum", signal.SIGTERM)
        what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"terminated ({signal.Signals(signum).name})"
        print(f"{what}: last.ckpt saved; run the same command again to resume", file=sys.stderr)
        sys.exit(128 + signum)  # 143 for SIGTERM, 130 for Ctrl-C: what schedulers and shells expect
    if objects["trainer"].is_global_zero:
        print(summary(metrics, objects))
    return metrics.get("val/loss")  # for Hydra sweepers that optimize a value


if __name__ == "__main__":
    main()
