"""The closing lines of a run: final validation numbers, downstream averages, the sample, where the
checkpoint and the model are, and how to open the run in MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from t6.run.samples import SAMPLES_ARTIFACT
from t6.tracking.mlflow import ui_path


def closing_summary(metrics: dict[str, float], objects: dict[str, Any]) -> str:
    trainer, mlflow, plan = objects["trainer"], objects["mlflow"], objects["plan"]
    lines = []
    if "val/loss" in metrics:
        lines.append(f"final val/loss {metrics['val/loss']:.4f}   val/ppl {metrics['val/ppl']:.2f}")
    for key in sorted(k for k in metrics if k.startswith("eval/") and k.endswith("/avg")):
        lines.append(f"{key:<15} {metrics[key]:.4f}   (per task: eval/{key.split('/')[1]}/<task>/<metric> in MLflow)")
    schedule = plan.schedule.describe() if plan.schedule else "constant learning rate (no lr_ablation.scheduler)"
    lines.append(f"schedule        {schedule}; {trainer.global_step} steps run")
    if objects.get("samples"):
        where = f" (every prompt: {SAMPLES_ARTIFACT} in MLflow)" if mlflow is not None else ""
        lines.append(f"sample          greedy{where}")
        lines.extend(f"    {line}" for line in objects["samples"][0].splitlines())
    final = Path(plan.checkpoint_dir) / "last.ckpt"
    if final.exists():
        lines.append(f"checkpoint      {final}   (ckpt_path=last in this run dir resumes from it)")
    if objects.get("uploaded"):
        lines.append(f"model           {objects['uploaded']}")
    if mlflow is not None and not mlflow.experiment_id:  # a resume while the store was down
        lines.append(
            f"MLflow run      {mlflow.run_id} (logged offline: {mlflow.outbox_dir} holds what the store lacks)"
        )
    elif mlflow is not None:
        lines.append(f"MLflow run      {mlflow.run_id} (experiment {mlflow.experiment_id})")
        lines.append(
            f"open it with    mlflow ui --backend-store-uri {plan.tracking.uri} --port 5000   "
            f"then http://127.0.0.1:5000/{ui_path(mlflow.experiment_id, mlflow.run_id)}"
        )
    return "\n".join(lines)
