"""The code files of an export: the project's own modules, copied, with their `t6` imports made relative.

transformers loads a model's code from its directory (remote code) and brings along the files its
modules import relatively (`from .name import x`, flat: no sub-folders). So the export copies

    t6/hf/modeling.py          -> modeling_t6.py        (T6ForCausalLM, T6Cache)
    t6/hf/configuration.py     -> configuration_t6.py   (T6Config)
    t6/model/<name>.py         -> <name>.py              (config, layers, t6, loss, static_decode, ...)
    t6/model/attention/__init__.py -> attention.py      (the registry)
    t6/model/attention/<name>.py   -> attention_<name>.py (the base, every registered mechanism)
    t6/errors.py               -> errors.py             (the errors a user can fix, which the model's checks raise)

every module the wrapper and the registered mechanisms import, found by following their `t6` imports,
each with its `from t6.x.y import names` lines rewritten to `from .<file> import names` and nothing else
changed. Two files differ from their module:
  - attention.py ends by importing every mechanism's module (the registry's `_discover` walks a package
    folder; the export's mechanisms are files beside it);
  - attention_fused_decode.py holds the eager form of each operator the mechanisms import (`tpa_decode =
    reference_tpa_decode`, ...): the export needs no C++ extension or Triton kernel.
So the export needs torch and transformers only, and runs the code training runs, for every mechanism.

A carried module may import from t6.model and t6.errors only, names rather than modules (`from t6.model.x import y`);
anything else is an error naming the module and the mechanism that needs it (docs/attention.md).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from t6.model.attention import Mechanism, available, get_mechanism

MODEL = "t6.model"
PACKAGE = "t6.model.attention"  # the registry
OPERATORS = "t6.model.attention.fused_decode"  # torch.library operators: carried as their eager forms
WRAPPER = "t6.hf.modeling"
ERRORS = "t6.errors"  # imports nothing: carried as it is
NAMES = {WRAPPER: "modeling_t6", "t6.hf.configuration": "configuration_t6", PACKAGE: "attention", ERRORS: "errors"}


def file_stem(module: str) -> str:
    """The module's file name in an export, without `.py`: t6.model.attention.tpa -> attention_tpa."""
    if module in NAMES:
        return NAMES[module]
    if module.startswith(PACKAGE + "."):
        return "attention_" + module.removeprefix(PACKAGE + ".")
    return module.removeprefix(MODEL + ".")


def module_path(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"module {module} has no source file")
    return Path(spec.origin)


def t6_imports(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """Every import of a t6 module in a parsed file, at any depth (type-hint and deferred imports too)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "t6"):
            found.append(node)
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "t6" for a in node.names):
            found.append(node)
    return found


def carried_imports(module: str, tree: ast.Module, who: str) -> list[str]:
    """The t6 modules `module` imports; an import the export cannot make relative is an error."""
    out = []
    for node in t6_imports(tree):
        target = node.module if isinstance(node, ast.ImportFrom) and not node.level else None
        allowed = target is not None and (
            target.startswith(MODEL) or target == ERRORS or (module == WRAPPER and target in NAMES)
        )
        if not allowed:
            raise ValueError(
                f"{who} cannot be exported: {module} has `{ast.unparse(node)}`; an export carries the modules of "
                f"{MODEL} and {ERRORS}, imported by name (`from {MODEL}.x import y`)"
            )
        if target == OPERATORS:
            continue  # written apart: their eager forms
        if target != PACKAGE and module_path(target).name == "__init__.py":
            raise ValueError(f"{who} cannot be exported: {module} imports the package {target}; import from a module")
        out.append(target)
    return out


def carried_modules(mechanisms: dict[str, Mechanism]) -> dict[str, str]:
    """Every module an export carries as it is (its `t6` imports aside) -> its source: the wrapper, the
    configuration, each mechanism's module, and what they import, followed through t6.model."""
    found: dict[str, str] = {}

    def visit(module: str, who: str) -> None:
        if module in found:
            return
        found[module] = module_path(module).read_text(encoding="utf-8")
        for dep in carried_imports(module, ast.parse(found[module]), who):
            visit(dep, who)

    for name, mechanism in sorted(mechanisms.items()):
        module = mechanism.cls.__module__
        who = f"attention={name} ({mechanism.cls.__name__}, {module})"
        if not module.startswith(PACKAGE + "."):
            raise ValueError(f"{who} cannot be exported: its class is not defined in a module of {PACKAGE}")
        visit(module, who)
    visit(WRAPPER, "the Hugging Face wrapper")
    visit("t6.hf.configuration", "the Hugging Face wrapper")
    return found


def relative(text: str) -> str:
    """The source with each `from t6.x.y import names` made `from .<file> import names` (the lines of the
    import statement's start; nothing else changes)."""
    lines = text.splitlines(keepends=True)
    for node in t6_imports(ast.parse(text)):
        i = node.lineno - 1
        lines[i] = lines[i].replace(f"from {node.module} import", f"from .{file_stem(node.module)} import", 1)
    return "".join(lines)


def registry_source(mechanisms: dict[str, Mechanism]) -> str:
    """attention.py: the registry, then an import of every mechanism's module (the export has no package
    folder to discover them in)."""
    imports = sorted({(m.cls.__module__, m.cls.__name__) for m in mechanisms.values()})
    lines = [f"from .{file_stem(module)} import {cls}  # noqa: E402, F401" for module, cls in imports]
    return (
        relative(module_path(PACKAGE).read_text(encoding="utf-8")).rstrip("\n")
        + "\n\n\n# The export: every mechanism's module is a file beside this one, imported here (t6.hf.source).\n"
        + "_discovered = True\n"
        + "\n".join(lines)
        + "\n"
    )


def operators_source(names: list[str]) -> str:
    """attention_fused_decode.py: each operator the mechanisms import, as its eager form `reference_<name>`
    from fused_decode.py, with the module functions those call."""
    text = module_path(OPERATORS).read_text(encoding="utf-8")
    functions = {n.name: n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)}
    wanted: list[str] = []

    def need(name: str) -> None:
        if name in wanted:
            return
        for node in ast.walk(functions[name]):
            if isinstance(node, ast.Name) and node.id in functions and node.id != name:
                need(node.id)
        wanted.append(name)

    for op in names:
        if f"reference_{op}" not in functions:
            raise ValueError(f"{OPERATORS} has no eager form reference_{op} of the operator {op}; the export needs one")
        need(f"reference_{op}")
    parts = [ast.get_source_segment(text, functions[name]) for name in wanted]
    parts += [f"{op} = reference_{op}  # the eager form of the operator t6::{op}" for op in names]
    head = f'"""The eager forms of {OPERATORS}\'s operators (t6.hf.source): no C++ or Triton."""\n\nimport torch\n'
    return head + "\n\n" + "\n\n\n".join(parts) + "\n"


def operator_names(sources: dict[str, str]) -> list[str]:
    """The operators the carried modules import from fused_decode, in order of first use."""
    names: list[str] = []
    for text in sources.values():
        for node in t6_imports(ast.parse(text)):
            if node.module == OPERATORS:
                names += [a.name for a in node.names if a.name not in names]
    return names


def export_sources(mechanisms: dict[str, Mechanism] | None = None) -> dict[str, str]:
    """The export's code files -> their text, for `mechanisms` (default: every registered one)."""
    if mechanisms is None:
        mechanisms = {name: get_mechanism(name) for name in available()}
    sources = carried_modules(mechanisms)
    files = {f"{file_stem(module)}.py": relative(text) for module, text in sources.items()}
    files["attention.py"] = registry_source(mechanisms)
    if names := operator_names(sources):
        files[f"{file_stem(OPERATORS)}.py"] = operators_source(names)
    return files
