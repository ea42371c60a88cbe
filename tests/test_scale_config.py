"""Scale-out configuration: trainers, the SLURM launcher, FineWeb data, the Docker files (no engine needed)."""

from __future__ import annotations

import re

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from conftest import CONF, ROOT


def compose_with_hydra(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=True)


def test_slurm_launcher_starts_one_task_per_gpu_of_the_trainer():
    cfg = compose_with_hydra("hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4", "trainer.num_nodes=2")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.tasks_per_node, launcher.gpus_per_node, launcher.nodes) == (4, 4, 2)


def test_paper_medium_run_composes(make_cfg):
    cfg = make_cfg("attention=tpa", "size=medium", "trainer=ddp", "data=fineweb_edu", small=False)
    assert cfg.trainer.strategy.gradient_as_bucket_view and cfg.trainer.devices == 8 and cfg.trainer.precision == "auto"
    assert cfg.data.global_batch_size == 480 and cfg.data.seq_len == 1024 and cfg.data.batch_size == "auto"
    dm = instantiate(cfg.data, batch_size=12)
    assert (
        dm.per_device_batch(cfg.trainer.devices) == 60 and dm.accumulation(cfg.trainer.devices) == 5
    )  # 480 = 12 x 8 x 5
    with pytest.raises(ValueError, match="global_batch_size=480 is not divisible by data.batch_size=12 x world size 7"):
        dm.accumulation(7)


def test_fsdp_strategy_wraps_each_block(make_cfg):
    from lightning.pytorch.strategies import FSDPStrategy

    from t6.model.t6 import Block

    cfg = make_cfg("trainer=fsdp", small=False)
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, FSDPStrategy) and strategy._state_dict_type == "full"
    policy = strategy.kwargs["auto_wrap_policy"]
    assert Block in policy._module_classes


def test_compose_file_has_a_tracking_server_and_a_trainer_pointing_at_it():
    compose_file = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose_file["services"]
    assert set(services) == {"mlflow", "trainer"}
    assert services["trainer"]["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert services["trainer"]["depends_on"]["mlflow"]["condition"] == "service_healthy"
    assert all(p.startswith("127.0.0.1:") for p in services["mlflow"]["ports"])  # never published on all interfaces
    volumes = {v.split(":")[0] for s in services.values() for v in s.get("volumes", [])}
    assert volumes <= set(compose_file["volumes"])
    assert services["mlflow"]["build"]["dockerfile"] == "docker/Dockerfile"


def test_dockerfile_is_pinned_and_runs_as_a_user():
    lines = [l.strip() for l in (ROOT / "docker" / "Dockerfile").read_text().splitlines()]
    instructions = []
    for line in lines:  # join continuation lines into instructions
        if instructions and instructions[-1].endswith("\\"):
            instructions[-1] = instructions[-1][:-1] + " " + line
        elif line and not line.startswith("#"):
            instructions.append(line)
    keywords = [i.split()[0] for i in instructions]
    known = {"FROM", "RUN", "COPY", "ENV", "WORKDIR", "USER", "ENTRYPOINT", "CMD", "ARG", "LABEL", "EXPOSE"}
    assert keywords[0] == "FROM" and set(keywords) <= known
    assert re.match(r"FROM nvidia/cuda:[\d.]+-", instructions[0])
    assert "USER" in keywords and instructions[keywords.index("USER")] != "USER root"
    assert any("-c constraints.txt" in i for i in instructions) and any("torch==2.13.0" in i for i in instructions)
    copied = [i.split()[1:-1] for i in instructions if i.startswith("COPY")]
    for sources in copied:
        for src in sources:
            assert (ROOT / src).exists(), src


def pins(lines) -> dict[str, str]:
    """{normalized name: version} of the `name==version` requirements among lines."""
    found = {}
    for line in lines:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;#]+)", line)
        if m:
            found[re.sub(r"[-_.]+", "-", m.group(1).lower())] = m.group(3)
    return found


def test_every_direct_pin_agrees_with_constraints_and_the_torch_installs():
    """pyproject's pins, constraints.txt (what a fresh machine resolves) and the torch version the
    Makefile and the Dockerfile install first must agree: two versions of one package make pip's
    resolution impossible on the machine that hits them (triton is pinned to the version torch's
    CUDA build requires, which the CPU build does not declare)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    direct = pins(project["dependencies"] + [r for rs in project["optional-dependencies"].values() for r in rs])
    constraints = pins((ROOT / "constraints.txt").read_text().splitlines())
    assert {k: constraints.get(k) for k in direct} == direct
    for installer in ("Makefile", "docker/Dockerfile"):
        assert re.findall(r"torch==([\w.+]+)", (ROOT / installer).read_text()) == [direct["torch"]], installer


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "dataset").glob("*.yaml")))
def test_prepare_datasets_compose(option, tmp_path):
    from omegaconf import OmegaConf

    from conftest import compose_config

    cfg = compose_config([f"dataset={option}", "dataset.data_files=/x.jsonl"], tmp_path, config_name="prepare")
    OmegaConf.resolve(cfg)
    assert cfg.dataset.out_dir.startswith(str(tmp_path))
