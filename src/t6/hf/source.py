"""The code files of an export, generated from the project's own modules so they cannot drift.

modeling_t6.py holds the model's modules (t6.model: config, layers, the attention base and
registry, every registered mechanism's module and what it imports, the backbone) and then
t6.hf.modeling, concatenated in dependency order with their `t6` imports removed: the file needs
torch and transformers, never `t6`. Two modules are carried in part:
  - t6.model.attention (the package): its registry functions, with discovery marked done,
    since every mechanism is defined in the file;
  - t6.model.attention.fused_decode: for each operator a mechanism imports (`tpa_decode`, ...)
    its eager form (`reference_tpa_decode`, ...), so no C++ or Triton kernel is needed.
configuration_t6.py is t6.hf.configuration as it is.

A mechanism whose module imports from outside t6.model, or defines a module-level name that
another carried module defines differently, cannot be carried in one file: an error names it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from t6.model.attention import Mechanism, available, get_mechanism

MODEL = "t6.model"
PACKAGE = "t6.model.attention"  # the registry; its `_discover` finds mechanism modules on disk
OPERATORS = "t6.model.attention.fused_decode"  # torch.library operators, carried as their eager forms
CONFIGURATION = "t6.hf.configuration"  # imported relatively, from configuration_t6.py next to the model file
WRAPPER = "t6.hf.modeling"
RULE = "#" + "-" * 99


def module_path(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"module {name} has no source file")
    return Path(spec.origin)


def display_path(name: str) -> str:
    """The module's file relative to src/, e.g. t6/model/attention/tpa.py (a package: its __init__.py)."""
    spec = importlib.util.find_spec(name) if name.startswith("t6.") else None
    package = spec is not None and spec.origin is not None and Path(spec.origin).name == "__init__.py"
    return name.replace(".", "/") + ("/__init__.py" if package else ".py")


@dataclass
class Source:
    """One module's source: its text, its imports of t6 modules and the names it defines."""

    name: str
    text: str
    tree: ast.Module = field(init=False)

    def __post_init__(self) -> None:
        self.tree = ast.parse(self.text)

    @functools.cached_property
    def t6_imports(self) -> list[ast.ImportFrom | ast.Import]:
        """Every import of a t6 module, at any depth (deferred imports inside functions too)."""
        found = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "t6"):
                found.append(node)
            elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "t6" for a in node.names):
                found.append(node)
        return found

    @functools.cached_property
    def outside_imports(self) -> list[ast.stmt]:
        """Top-level imports of other packages (hoisted to the top of the file), `__future__` excluded."""
        return [
            node
            for node in self.tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom))
            and node not in self.t6_imports
            and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")
        ]

    def definitions(self) -> dict[str, str]:
        """Module-level names this module binds -> their source (functions, classes, assignments)."""
        out = {}
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = ast.unparse(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name) and name.id != "__all__":
                            out[name.id] = ast.unparse(node)
        return out

    def body(self) -> str:
        """The text without its imports (hoisted or of t6 modules), `from __future__`, `__all__` and its
        `if TYPE_CHECKING:` blocks (imports for type hints only, of names the one file defines)."""
        removed = [*self.t6_imports, *self.outside_imports]
        for node in self.tree.body:
            future = isinstance(node, ast.ImportFrom) and node.module == "__future__"
            exports = isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
            hints = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            if future or exports or hints:
                removed.append(node)
        drop = {i for node in removed for i in range(node.lineno, node.end_lineno + 1)}
        lines = [line for i, line in enumerate(self.text.splitlines(), start=1) if i not in drop]
        return "\n".join(lines).strip("\n")


def read_source(name: str) -> Source:
    return Source(name, module_path(name).read_text(encoding="utf-8"))


def imported_modules(source: Source) -> dict[str, list[str]]:
    """t6 module -> the names `source` imports from it (`from t6.x import a, b`); other forms are errors."""
    out: dict[str, list[str]] = {}
    for node in source.t6_imports:
        if isinstance(node, ast.Import) or node.level:
            raise ValueError(
                f"{display_path(source.name)}: `{ast.unparse(node)}`: the export carries `from t6.x import name` "
                "imports only"
            )
        out.setdefault(node.module, []).extend(a.name for a in node.names)
    return out


@dataclass
class Plan:
    """What modeling_t6.py carries: whole modules in dependency order, the operators' eager forms,
    and for each module the mechanisms that need it (for errors that name them)."""

    modules: list[str] = field(default_factory=list)
    operators: list[str] = field(default_factory=list)
    needed_by: dict[str, set[str]] = field(default_factory=dict)
    sources: dict[str, Source] = field(default_factory=dict)  # every module read, by name

    def source(self, name: str) -> Source:
        if name not in self.sources:
            self.sources[name] = read_source(name)
        return self.sources[name]


def plan(mechanisms: dict[str, Mechanism], sources: dict[str, Source] | None = None) -> Plan:
    """Modules (and operators) that the wrapper, the backbone and every mechanism in `mechanisms` need.
    sources: modules' sources by name, read from their files when not given."""
    out = Plan(sources=dict(sources or {}))
    visiting: set[str] = set()

    def visit(name: str, who: str) -> None:
        out.needed_by.setdefault(name, set()).add(who)
        if name in out.modules or name in visiting:
            return
        visiting.add(name)
        for dep, names in imported_modules(out.source(name)).items():
            if dep == CONFIGURATION and name == WRAPPER:
                continue
            if dep == OPERATORS:
                out.operators += [n for n in names if n not in out.operators]
                continue
            if dep != MODEL and not dep.startswith(MODEL + "."):
                raise ValueError(
                    f"{who} cannot be exported: {display_path(name)} imports {dep}, and an export carries only "
                    f"the modules of {MODEL} (with {WRAPPER}); move what it needs into {MODEL}"
                )
            visit(dep, who)
        visiting.discard(name)
        out.modules.append(name)  # after its dependencies

    for mech_name, mechanism in sorted(mechanisms.items()):
        module = mechanism.cls.__module__
        who = f"attention={mech_name} ({mechanism.cls.__name__}, {module})"
        if not module.startswith(PACKAGE + "."):
            raise ValueError(f"{who} cannot be exported: its class is not defined in a module of {PACKAGE}")
        visit(module, who)
    visit(WRAPPER, "the Hugging Face wrapper")  # last: the backbone and the HF classes follow the mechanisms
    return out


def merged_imports(nodes: list[ast.stmt]) -> list[str]:
    """The modules' top-level imports, one statement per imported module, sorted."""
    plain: set[str] = set()
    names: dict[str, set[str]] = {}
    for node in nodes:
        aliases = [a.name + (f" as {a.asname}" if a.asname else "") for a in node.names]
        if isinstance(node, ast.Import):
            plain.update(aliases)
        else:
            names.setdefault(node.module, set()).update(aliases)
    return [f"import {a}" for a in sorted(plain)] + [
        f"from {module} import {', '.join(sorted(aliases))}" for module, aliases in sorted(names.items())
    ]


def operator_source(source: Source, operators: list[str]) -> str:
    """The eager form of each operator of fused_decode (`source`), bound to the operator's name."""
    functions = {n.name: n for n in source.tree.body if isinstance(n, ast.FunctionDef)}
    parts = []
    for op in operators:
        reference = functions.get(f"reference_{op}")
        if reference is None:
            raise ValueError(
                f"{display_path(OPERATORS)} has no eager form reference_{op} of the operator {op} that a mechanism "
                "imports; the export needs one"
            )
        parts.append(ast.get_source_segment(source.text, reference))
        parts.append(f"{op} = reference_{op}  # the eager form of the operator t6::{op}")
    return "\n\n\n".join(parts)


def check_names(sources: list[Source], operators: list[str], needed_by: dict[str, set[str]]) -> None:
    """One module-level binding per name across the carried modules (identical definitions may repeat)."""
    owner: dict[str, tuple[str, str]] = {}
    problems = []
    for source in sources:
        defined = source.definitions()
        if source.name == OPERATORS:
            defined = {n: f"reference_{n}" for n in operators} | {f"reference_{n}": n for n in operators}
        for name, text in defined.items():
            if name in owner and owner[name][1] != text:
                who = ", ".join(sorted(needed_by.get(source.name, {source.name})))
                problems.append(
                    f"{who}: {display_path(source.name)} defines `{name}`, which {display_path(owner[name][0])} "
                    "defines too; rename one (the export puts every module in one file)"
                )
            owner.setdefault(name, (source.name, text))
    if problems:
        raise ValueError("cannot generate modeling_t6.py:\n  - " + "\n  - ".join(problems))


def modeling_source(mechanisms: dict[str, Mechanism] | None = None) -> str:
    """modeling_t6.py for `mechanisms` (default: every registered one)."""
    if mechanisms is None:
        mechanisms = {name: get_mechanism(name) for name in available()}
    layout = plan(mechanisms)
    sources = [layout.source(name) for name in layout.modules]
    carried = [*sources, layout.source(OPERATORS)] if layout.operators else sources
    check_names(carried, layout.operators, layout.needed_by)
    imports = merged_imports([node for source in sources for node in source.outside_imports])
    sections = []
    if layout.operators:
        operators = operator_source(layout.source(OPERATORS), layout.operators)
        sections.append(f"{RULE}\n# {display_path(OPERATORS)}: eager forms\n\n{operators}")
    for source in sources:
        sections.append(f"{RULE}\n# {display_path(source.name)}\n\n{source.body()}")
        if source.name == PACKAGE:
            if "_discovered" not in source.definitions():
                raise ValueError(f"{display_path(PACKAGE)} no longer defines `_discovered`; update t6.hf.source")
            sections.append("_discovered = True  # every mechanism is defined in this file, nothing to discover")
    text = "\n\n\n".join(
        [
            f'"""{MODELING_DOC}"""',
            "from __future__ import annotations",
            "\n".join([*imports, "from .configuration_t6 import T6Config"]),
            *sections,
        ]
    )
    ast.parse(text)  # the file must be valid Python
    return text + "\n"


MODELING_DOC = """T6 (Tensor Product Attention Is All You Need, arXiv 2501.06425) and its attention mechanisms
as a Hugging Face causal LM, generated by T6 Lab (t6.hf.source) from its own modules, each under a
header naming its file; change those and export again rather than editing this file.
"""


def configuration_source() -> str:
    """configuration_t6.py: t6.hf.configuration as it is."""
    return module_path(CONFIGURATION).read_text(encoding="utf-8")
