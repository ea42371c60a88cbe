"""The documentation says what the code does: its commands run as typed (shrunk by overrides only) and print
what it promises; its measured tables are rendered from their JSON; its facts tables match the models; its
links resolve; the package's layers import as docs/architecture.md says; the README stays short."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, seed_store

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(path: Path, kind: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang == kind]


def test_the_readme_is_read_in_ten_minutes():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_measured_tables_are_rendered_from_their_json():
    from t6.report.experiments import main, readmes

    assert readmes(ROOT / "experiments"), "no experiments README declares a table"
    assert main(["--check", "--root", str(ROOT / "experiments")]) == 0


def test_links_point_at_files_that_exist():
    missing = []
    for doc in [*DOCS, *sorted((ROOT / "experiments").rglob("README.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://")) and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not missing, missing


def layer_order() -> list[str]:
    """The layers in the order docs/architecture.md lists them."""
    names = re.findall(r"^\| `([\w.]+)/?`(?:, `(\w+)/`)? \|", (ROOT / "docs" / "architecture.md").read_text(), re.M)
    return [n.removesuffix(".py") for pair in names for n in pair if n]


def test_each_layer_imports_only_the_layers_before_it():
    order = layer_order()
    assert order[:4] == ["errors", "model", "hydra_config", "data"] and "run" in order
    rank = {name: i for i, name in enumerate(order)}
    src = ROOT / "src" / "t6"
    upward = []
    for path in src.rglob("*.py"):
        layer = path.relative_to(src).parts[0].removesuffix(".py")
        if layer == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            modules += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for module in (m for m in modules if m.startswith("t6.")):
                target = module.split(".")[1]
                if target != layer and rank.get(target, -1) >= rank.get(layer, len(order)):
                    upward.append(f"{path.relative_to(src)} imports {module}")
    assert not upward, upward


def test_the_readmes_layout_lists_every_layer_in_the_architectures_order():
    """The README's layout of src/t6 names each layer (package or top-level module) that exists, each once, in the
    order docs/architecture.md gives them (the order they import in)."""
    layout = (ROOT / "README.md").read_text().split("## Layout")[1].split("```")[1].splitlines()
    start = next(i for i, line in enumerate(layout) if line.startswith("src/t6/"))
    block = layout[start + 1 : next(i for i in range(start + 1, len(layout)) if not layout[i].startswith(" "))]
    listed = [
        name.removesuffix("/").removesuffix(".py")
        for line in block
        if re.match(r"^  \S", line)  # a layer: two spaces in; deeper lines are inside one
        for name in line.strip().split("  ")[0].split()
    ]
    src = ROOT / "src" / "t6"
    layers = {p.name.removesuffix(".py") for p in src.iterdir() if (p.is_dir() and any(p.glob("*.py")))
              or (p.suffix == ".py" and p.name != "__init__.py")}  # fmt: skip
    assert sorted(listed) == sorted(layers), "the README's layout and src/t6 differ"
    assert listed == layer_order(), "the README lists the layers in another order than docs/architecture.md"


def test_two_modules_share_a_file_name_only_where_a_benchmark_measures_the_other():
    """A file name says what the module holds: two modules with one name are a benchmark (bench/NAME.py, the
    command `python -m t6.bench.NAME`) and the thing it measures, never two ideas under one name."""
    src = ROOT / "src" / "t6"
    by_name: dict[str, list[str]] = {}
    for path in src.rglob("*.py"):
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(str(path.parent.relative_to(src)))
    shared = {name: sorted(folders) for name, folders in by_name.items() if len(folders) > 1}
    assert all(len(f) == 2 and "bench" in f for f in shared.values()), shared


def facts_table(text: str, first_header: str) -> list[list[str]]:
    """The rows of the markdown table whose first header cell is `first_header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


@pytest.mark.slow  # builds every mechanism at every paper size on the meta device (~15 s)
def test_the_parameter_table_is_the_models_own(tmp_path):
    """docs/attention.md: heads / parameters of every mechanism at every size, as the built model counts them."""
    from t6.hydra_config import model_config
    from t6.model.facts import parameter_count

    from conftest import compose_config

    sizes = ["tiny", "small", "medium", "large", "xl"]
    table = facts_table((ROOT / "docs" / "attention.md").read_text(), " | ".join(["option", *sizes]))
    assert len(table) >= 13
    for row in table:
        for name in re.findall(r"`(\w+)`", row[0]):
            for size, cell in zip(sizes, row[1:]):
                mcfg = model_config(compose_config([f"attention={name}", f"size={size}"], tmp_path))
                assert cell == f"{mcfg.n_head} / {parameter_count(mcfg) / 1e6:.2f}M", (name, size)


def placeholder(expected: str) -> re.Pattern:
    """An output line as the docs print it: `<...>` stands for any text, runs of spaces for any spacing."""
    parts = re.split(r"<[^>]*>", expected.strip())
    return re.compile(".*".join(r"\s+".join(map(re.escape, part.split())) for part in parts))


def console_commands(path: Path) -> list[tuple[str, list[str]]]:
    """(command, the output lines it promises) of every ```console block: `$ ` lines are commands, the lines
    after one are lines its output must contain, in order (`...` skips any number of lines)."""
    out: list[tuple[str, list[str]]] = []
    for body in blocks(path, "console"):
        for line in body.splitlines():
            if line.startswith("$ "):
                out.append((line[2:], []))
            elif line.strip() and line.strip() != "...":
                out[-1][1].append(line)
    return out


# What shrinks each entry point to a test's size: overrides appended to the command as typed (the last value
# of a key wins), writing under the test's own root.
SHRINK = {
    "train.py": [
        "size.n_layer=2",
        "size.d_model=64",
        "size.n_head=4",
        "size.head_dim=16",
        "size.block_size=64",
        "data.batch_size=4",
        "data.global_batch_size=4",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "data.val_windows=8",
        "eval.limit=8",
        "samples.max_new_tokens=4",
        "paths.root_dir={root}",
    ],
    "eval.py": ["eval.limit=8", "paths.root_dir={root}"],
    "generate.py": ["max_new_tokens=8"],
    "summary.py": [],
    "report.py": ["--out", "{root}/report"],
    "export.py": ["paths.root_dir={root}"],
    "t6.bench.decode": ["--steps", "1", "--rounds", "1", "--warmup", "0"],
}


def shrunk(command: str, root: Path) -> list[str]:
    """The command with its placeholders filled from the files earlier commands wrote under root, and the
    overrides that shrink it."""

    def newest(pattern: str) -> str:
        found = sorted((root / "logs").glob(pattern))
        assert found, f"no {pattern} under {root}/logs for `{command}`"
        return str(found[-1])

    command = command.replace("/tmp/", f"{root}/tmp/")  # what the docs write to /tmp goes under root
    for typed, written in (
        ("logs/train/runs/<time>", "train/runs/*"),
        ("logs/train/multiruns/<time>", "train/multiruns/*"),
    ):
        if typed in command:
            command = command.replace(typed, newest(written))
    args = shlex.split(command)
    assert args[0] == "python", command
    entry = args[2] if args[1] == "-m" else args[1]
    assert entry in SHRINK, f"`{command}`: no shrink rule for {entry}"
    return [sys.executable, *args[1:], *(arg.format(root=root) for arg in SHRINK[entry])]


@pytest.mark.slow  # trains, sweeps, evaluates and generates through the entry scripts (~4 min on 2 cores)
@pytest.mark.parametrize("doc", [d for d in DOCS if blocks(d, "console")], ids=lambda d: d.name)
def test_documented_commands_run_as_typed_and_print_what_they_promise(doc, tmp_path, monkeypatch):
    env = {**__import__("os").environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlruns/mlflow.db"}
    seed_store(tmp_path / "mlruns" / "mlflow.db")
    for command, promised in console_commands(doc):
        done = subprocess.run(shrunk(command, tmp_path), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{done.stderr[-3000:]}"
        lines = done.stdout.splitlines()
        for expected in promised:
            pattern = placeholder(expected)
            at = next((i for i, line in enumerate(lines) if pattern.fullmatch(line.strip())), None)
            assert at is not None, f"`{command}` did not print {expected!r}; it printed:\n{done.stdout[-3000:]}"
            lines = lines[at + 1 :]


# Commands in ```bash blocks are not run by the suite; each needs what a test machine does not have.
NEEDS = {
    "make ": "the install itself (CI runs `make test`)",
    "torchrun": "several processes on GPUs",
    "hydra/launcher=slurm": "a SLURM cluster",
    "docker": "a Docker engine",
    "mlflow server": "a long-running server",
    "mlflow ui": "a long-running server",
    "export MLFLOW_TRACKING_URI": "a tracking server",
    "trainer=ddp": "several GPUs",
    "trainer=fsdp": "several GPUs",
    "trainer=gpu": "a GPU",
    "--device cuda": "a GPU",
    "compile=true": "a GPU (the CPU compiles for minutes)",
    "experiment=paper": "a paper-scale run on 8 GPUs",
    "experiment=lr_ablation": "a paper-scale run on 8 GPUs",
    "dataset=fineweb_edu": "the internet (FineWeb-Edu from the Hugging Face Hub)",
    "data=fineweb_edu": "prepared FineWeb-Edu shards",
    "eval=paper": "the internet (the paper's datasets from the Hugging Face Hub)",
    "experiments/": "a study of hours (its script)",
    "=...": "a value the reader fills in",
    "NAME": "a value the reader fills in",
    "RUN_ID": "a value the reader fills in",
    "data=local": "the reader's own prepared shards",
    "<": "a value the reader fills in",
    "--size medium": "minutes of CPU per mechanism at medium width",
    "--size small": "minutes of CPU per mechanism at small width",
    "--size large": "a GPU (large width)",
    "--sizes": "a benchmark of the paper's widths",
    "t6.bench.train_memory": "a training step per case in a fresh process",
    "t6.bench.loss": "a training step per setting in a fresh process",
    "t6.bench.loader": "the tokenized corpus and a training step",
    "/data/": "the reader's own data",
    "/path/to/": "the reader's own files",
    "convert.py": "a source model (a trained checkpoint, an export or a pretrained Llama)",
    "~/models/": "a pretrained model the reader has (a Hugging Face directory or a GGUF file)",
    "init_from=ckpt/": "a converted checkpoint",
    "experiment=uptrain": "a converted checkpoint",
    "-m attention=mha,mqa,gqa,mla,tpa_kvonly,tpa": "six runs of the paper's sizes",
    "lm_eval": "lm-eval's own CLI on a checkpoint",
    "t6.evaluation": "lm-eval's own CLI on a checkpoint",
    "ssh": "another machine",
    "python -c": "Python on the export (tests/test_export.py loads it so)",
    "t6.bench.suite": "a GPU for eight minutes (its --smoke run on the CPU is tests/test_suite.py)",
    "tools/gpu/": "a package index, for the GPU machine's wheels",
    ".gpu/env.sh": "a GPU machine without a package index",
}


def test_every_command_the_docs_do_not_run_says_what_it_needs():
    unclassified = []
    for doc in DOCS:
        for body in blocks(doc, "bash"):
            for line in body.replace("\\\n", " ").splitlines():
                command = line.split("#")[0].strip()
                if command and not any(key in command for key in NEEDS):
                    unclassified.append(f"{doc.relative_to(ROOT)}: {command}")
    assert not unclassified, (
        "commands in ```bash blocks the suite does not run: make them ```console blocks (run, shrunk by "
        f"SHRINK) or name what they need in NEEDS: {unclassified}"
    )


def runtime_imports(path: Path) -> set[str]:
    """The t6 modules a file imports when it runs (deferred imports too), not those only type hints read."""
    tree = ast.parse(path.read_text())
    hints = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for n in ast.walk(block)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in hints:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("t6"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("t6"))
    return out


def test_no_module_imports_itself_through_others():
    """The import graph of src/t6, deferred imports included, has no cycle (a package counts as its __init__)."""
    src = ROOT / "src"
    graph = {}
    for path in (src / "t6").rglob("*.py"):
        name = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m for m in runtime_imports(path) if m != name}
    cycles = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in stack:
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in done:
                visit(nxt, [*stack, nxt], done)
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            visit(start, [start], done)
    assert not cycles, cycles


def test_every_import_of_the_package_names_what_exists():
    """Each `from t6.X import name` in src/t6 and the entry scripts, deferred ones included, names a module that
    exists and a name it defines: a rename cannot leave an import inside a function (run only on a GPU, say) behind.
    Checked on the source's syntax trees, nothing imported."""
    src = ROOT / "src"
    defined: dict[str, set[str]] = {}
    for path in (src / "t6").rglob("*.py"):
        module = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        defined[module] = names
    missing = []
    for path in [*(src / "t6").rglob("*.py"), *ROOT.glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "t6":
                if node.module not in defined:
                    missing.append(f"{path.relative_to(ROOT)}: no module {node.module}")
                    continue
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if alias.name not in defined[node.module] and sub not in defined:
                        missing.append(f"{path.relative_to(ROOT)}: {node.module} has no {alias.name}")
    assert not missing, missing
