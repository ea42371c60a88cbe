"""The Docker image and compose file, checked where no Docker daemon runs (CI, this machine):
hadolint on the Dockerfile, the compose services' volumes, users and grace period against what
the image creates, and the services' commands run outside the container with the same arguments."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
BIN = Path(sys.executable).parent


def dockerfile_text() -> str:
    return DOCKERFILE.read_text().replace("\\\n", " ")


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([str(BIN / "hadolint"), str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_image_holds_every_entry_script():
    copied = {w for line in dockerfile_text().splitlines() if line.startswith("COPY ") for w in line.split()[1:-1]}
    scripts = {p.name for p in ROOT.glob("*.py")}
    assert scripts <= copied, f"not copied into the image: {sorted(scripts - copied)}"


def test_services_write_only_where_the_image_gives_their_user_ownership():
    text = dockerfile_text()
    owned = set(re.search(r"chown -R t6:t6 ([^\n&]+)", text).group(1).split())
    assert "useradd --create-home --uid 1000 t6" in text and "USER 1000:1000" in text
    for name, service in COMPOSE["services"].items():
        assert service.get("user", "1000:1000") == "1000:1000", name
        for volume in service.get("volumes", []):
            target = volume.split(":")[1]
            assert target in owned, (
                f"service {name} mounts a volume on {target}, which the image does not create for uid 1000"
            )


def test_trainer_gets_time_to_save_its_checkpoint_on_stop():
    grace = COMPOSE["services"]["trainer"]["stop_grace_period"]
    value, unit = int(grace[:-1]), grace[-1]
    assert value * {"s": 1, "m": 60, "h": 3600}[unit] >= 300  # docker's default is 10 s


def test_trainer_command_composes_outside_the_container(tmp_path):
    args = COMPOSE["services"]["trainer"]["command"]  # ["train.py", "trainer=gpu"]
    env = {
        **os.environ,
        "T6_ROOT": str(tmp_path),
        "PYTHONPATH": str(ROOT / "src"),
        "MLFLOW_TRACKING_URI": COMPOSE["services"]["trainer"]["environment"]["MLFLOW_TRACKING_URI"],
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / args[0]), *args[1:], "--cfg", "job", "--resolve"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["trainer"]["accelerator"] == "gpu" and cfg["logger"]["mlflow"]["tracking_uri"] == "http://mlflow:5000"


@pytest.mark.slow
def test_mlflow_service_starts_with_its_compose_arguments(tmp_path):
    """The mlflow service's entrypoint and arguments, its /mlflow volume replaced by an empty
    directory of this user, until its health check (the one compose runs) answers."""
    service = COMPOSE["services"]["mlflow"]
    store = tmp_path / "mlflow"
    store.mkdir()
    port = 5000 + os.getpid() % 1000
    args = [
        a.replace("/mlflow/", f"{store}/").replace("0.0.0.0", "127.0.0.1").replace("5000", str(port))
        for a in service["command"]
    ]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [str(BIN / service["entrypoint"][0]), *args, "--workers", "1"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        check = service["healthcheck"]["test"][-1].replace("5000", str(port))
        deadline = time.monotonic() + 240
        while subprocess.run([sys.executable, "-c", check], capture_output=True).returncode != 0:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the health check never passed"
            time.sleep(1)
        assert (store / "mlflow.db").is_file()  # the store was created in the volume
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
