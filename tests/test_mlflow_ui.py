"""The MLflow UI, seen in a real browser: a short real training run (plus eval metrics logged as test
data) served by `mlflow server` on 127.0.0.1 and opened in headless Chromium through selenium.

The screenshots are kept in tests/artifacts/ (git-ignored); their paths are printed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest

from t6.run.closing import closing_summary
from t6.run.train import main as train
from t6.tracking.mlflow import ui_path

from conftest import ROOT

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
ARTIFACTS = ROOT / "tests" / "artifacts"
# logged by the real evaluation callback (the embedded next-line task, a few items)
EVAL_METRICS = [
    "eval/0shot/t6_next_line/acc_norm",
    "eval/2shot/t6_next_line/acc_norm",
    "eval/0shot/avg",
    "eval/2shot/avg",
]


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Headless Chromium and its driver from Debian's packages (`make test` installs them as root),
    installed here too when missing and we are root. Without them the test skips, except under
    CI=true, where it fails: CI must open the browser, not pass without it."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            message = (
                "needs /usr/bin/chromium and /usr/bin/chromedriver: apt-get install chromium chromium-driver (as root)"
            )
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"CI=true: {message}")
            pytest.skip(message)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=300", "chromium", "chromium-driver"],
            check=True,
            env=env,
        )
    return CHROMIUM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """start(store_uri) -> base URL of `mlflow server` on 127.0.0.1, stopped by its process group afterwards."""
    procs = []

    def start(store_uri: str) -> str:
        port = free_port()
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        log = open(tmp_path / "mlflow_server.log", "wb")
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "mlflow"),
                "server",
                "--backend-store-uri",
                store_uri,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(
                    f"mlflow server exited with {proc.returncode}: "
                    f"{(tmp_path / 'mlflow_server.log').read_text()[-2000:]}"
                )
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                return url
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"mlflow server did not answer on {url} within 120 s")

    yield start
    for proc in procs:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def browser(chromium):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1600,1200",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait_for_text(driver, texts: list[str], timeout: float = 90.0) -> str:
    """The page's visible text once it contains every one of texts (the UI loads runs asynchronously)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    body = ""

    def shown(d) -> bool:
        nonlocal body
        body = d.find_element(By.TAG_NAME, "body").text
        return all(t in body for t in texts)

    try:
        WebDriverWait(driver, timeout, poll_frequency=0.5).until(shown)
    except Exception as err:
        lacking = [t for t in texts if t not in body]
        raise AssertionError(f"{driver.current_url} does not show {lacking}; it shows:\n{body[:3000]}") from err
    return body


def screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    print(f"screenshot: {path}")
    return path


def test_mlflow_ui_shows_the_run_its_losses_and_eval_metrics(make_cfg, mlflow_server, browser):
    cfg = make_cfg(
        "run_name=ui-check",
        "callbacks.model_checkpoint=null",
        "eval=local",
        "eval.limit=8",
        "logger.mlflow.system_metrics_interval_s=0.5",
    )
    metrics, objects = train(cfg)
    run_id, experiment_id = objects["mlflow"].run_id, objects["mlflow"].experiment_id
    client = mlflow.MlflowClient(tracking_uri=cfg.logger.mlflow.tracking_uri)
    assert set(EVAL_METRICS) <= set(client.get_run(run_id).data.metrics)

    system = sorted(k for k in client.get_run(run_id).data.metrics if k.startswith("system/"))
    assert "system/cpu_utilization_percentage" in system and "system/system_memory_usage_megabytes" in system

    url = mlflow_server(cfg.logger.mlflow.tracking_uri)
    # The link the closing summary prints opens the run in MLflow's model-training view (runs,
    # models, registry), not its GenAI view (traces, sessions, judges, "Evaluation runs").
    link = re.search(r"then http://127.0.0.1:5000/(\S+)", closing_summary(metrics, objects)).group(1)
    assert link == ui_path(experiment_id, run_id)
    for path in (ui_path(experiment_id), link):
        browser.get(f"{url}/{path}")
        body = wait_for_text(browser, ["ui-check", "Model registry"])
        for genai in ("Evaluation runs", "Judges", "Sessions"):
            assert genai not in body, f"{path} opened in MLflow's GenAI view:\n{body[:2000]}"
    assert "workflowType=machine_learning" in browser.current_url
    assert screenshot(browser, "mlflow_training_view.png").stat().st_size > 10_000
    browser.get(f"{url}/#/experiments/{experiment_id}/runs")
    wait_for_text(browser, ["ui-check"])
    assert screenshot(browser, "mlflow_runs.png").stat().st_size > 10_000

    browser.get(f"{url}/#/experiments/{experiment_id}/runs/{run_id}")
    body = wait_for_text(browser, ["ui-check", "val/loss", "val/ppl", *EVAL_METRICS])
    val_loss = client.get_run(run_id).data.metrics["val/loss"]
    assert f"{val_loss:.3f}"[:4] in body  # the value, not just the name
    assert screenshot(browser, "mlflow_run.png").stat().st_size > 10_000

    browser.get(f"{url}/#/experiments/{experiment_id}/runs/{run_id}/system-metrics?workflowType=machine_learning")
    wait_for_text(browser, ["cpu_utilization_percentage"])  # the run's system-metrics tab has charts
    assert screenshot(browser, "mlflow_system_metrics.png").stat().st_size > 10_000
