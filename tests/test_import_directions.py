"""Dependencies run one way, read from the source (ast): the model package (raven_layers) runs the kernels
(raven_kernels) only through the kernel modules its mixers name (backend.kernel_module), the pipeline (raven_convert)
imports both, and the kernels import the model package only from their reference and benchmark modules
(kernels/<mixer>/naive.py, benchmark.py), which no other module imports. No module imports its importer, the kernel
modules the model loads at run time included; within a package, the modules of NOT_IMPORTED keep off the parts it
names (layer_choice off the training package, which imports it); and nothing imports a folder by its folder name
(convert, kernels)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from raven_layers import decode_attention
from raven_layers.registry import BUILTIN_MIXERS
from tests.helpers import REPO, TOOLKIT_PACKAGES, package_folder

MAY_IMPORT = {"raven_convert": {"raven_kernels", "raven_layers"}, "raven_kernels": set(), "raven_layers": set()}
REFERENCE_MODULES = ("naive", "benchmark")  # kernel modules that may import raven_layers: references and timings
FOLDER_NAMES = {"convert": "raven_convert", "kernels": "raven_kernels"}  # folder -> import name, where they differ
# module -> (the modules and packages it may not import, why): dependencies within a package that run one way
NOT_IMPORTED = {
    "raven_convert.layer_choice": (
        ("raven_convert.train",),
        "the training package imports it; its caller hands in what it borrows from training (TrainingParts)",
    ),
}

Edge = tuple[str, str, str]  # (imported module, where: "path:line", the statement)


def find_modules(roots: dict[str, Path]) -> dict[str, Path]:
    """Every module of the packages `roots` (import name -> folder), by import name."""
    found = {}
    for top, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = (top, *path.relative_to(root).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(path: Path, package: str) -> list[tuple[str, int, str]]:
    """(name, line, statement) of each import in the file `path` of `package` (module-level or not): `import M`
    gives M, `from M import x` gives M.x (a module, or a name in M), relative imports resolved."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *filter(None, [node.module])])
            names = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(name, node.lineno, ast.get_source_segment(source, node)) for name in names]
    return found


def import_graph(modules: dict[str, Path], root: Path = REPO) -> dict[str, list[Edge]]:
    """For each module, the modules of `modules` it imports (the deepest one each import names); files are named
    relative to `root`."""
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = {}
        for target, line, statement in imported_names(path, package):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                edges.setdefault((target, statement), f"{path.relative_to(root)}:{line}")
        graph[name] = [(target, where, statement) for (target, statement), where in edges.items()]
    return graph


def kernel_modules() -> dict[str, Edge]:
    """The kernel module each model module loads at run time (the mixers' MixerSpec.kernels, decode attention's)."""
    loads = {spec.layer.__module__: (spec.kernels, f"MIXER.kernels = {spec.kernels!r}") for spec in BUILTIN_MIXERS}
    loads[decode_attention.__name__] = (decode_attention.KERNELS, f"KERNELS = {decode_attention.KERNELS!r}")
    return {module: (kernels, f"{module} (run time)", line) for module, (kernels, line) in loads.items() if kernels}


def is_reference(module: str) -> bool:
    return module.startswith("raven_kernels.") and module.rpartition(".")[2] in REFERENCE_MODULES


def wrong_directions(graph: dict[str, list[Edge]]) -> list[str]:
    problems = []
    for module, edges in graph.items():
        top = module.split(".")[0]
        for target, where, statement in edges:
            other = target.split(".")[0]
            if is_reference(target) and not is_reference(module):
                problems.append(
                    f"{where}: {module} imports {target} ({statement!r}), a reference or benchmark module, which "
                    "imports the model package: only tests and other such modules may import it"
                )
            elif (
                other != top and other not in MAY_IMPORT[top] and not (is_reference(module) and other == "raven_layers")
            ):
                allowed = ", ".join(sorted(MAY_IMPORT[top])) or "nothing of the toolkit outside itself"
                problems.append(f"{where}: {module} imports {target} ({statement!r}); {top} may import {allowed}")
    return problems


def forbidden_imports(graph: dict[str, list[Edge]], rules: dict = NOT_IMPORTED) -> list[str]:
    """The imports `rules` forbid (a module, or any module of a package it names)."""
    problems = []
    for module, (forbidden, why) in rules.items():
        for target, where, statement in graph.get(module, ()):
            if any(target == name or target.startswith(name + ".") for name in forbidden):
                problems.append(f"{where}: {module} imports {target} ({statement!r}); it may not: {why}")
    return problems


def cycles(graph: dict[str, list[Edge]]) -> list[str]:
    """Each import cycle once (by its first module in DFS order), as the chain of imports that closes it."""
    found, done, path = [], set(), []

    def visit(module: str) -> None:
        path.append(module)
        for target, _, _ in graph.get(module, ()):
            if target in path:
                chain = path[path.index(target) :] + [target]
                steps = [f"{a} -> {b} ({w}: {s!r})" for a, b in zip(chain, chain[1:]) for t, w, s in graph[a] if t == b]
                found.append("import cycle: " + "; ".join(dict.fromkeys(steps)))
            elif target not in done:
                visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return found


def folder_name_imports(paths) -> list[str]:
    problems = []
    for path in paths:
        for name, line, statement in imported_names(path, ""):
            top = name.split(".")[0]
            if top in FOLDER_NAMES and not statement.startswith("from ."):
                problems.append(
                    f"{path.relative_to(REPO)}:{line}: {statement!r} imports the folder {top}/ by its folder name; "
                    f"it installs as {FOLDER_NAMES[top]}"
                )
    return problems


def toolkit_graph(run_time: bool) -> dict[str, list[Edge]]:
    """The toolkit's imports; with `run_time`, also the kernel modules the model loads."""
    graph = import_graph(find_modules({top: package_folder(top) for top in TOOLKIT_PACKAGES}))
    for module, edge in kernel_modules().items() if run_time else ():
        graph[module].append(edge)
    return graph


def test_packages_import_one_way():
    problems = wrong_directions(toolkit_graph(run_time=False))
    assert not problems, "imports against the direction of the packages:\n" + "\n".join(problems)


def test_modules_keep_off_what_they_may_not_import():
    problems = forbidden_imports(toolkit_graph(run_time=False))
    assert not problems, "\n".join(problems)


def test_no_module_imports_its_importer():
    problems = cycles(toolkit_graph(run_time=True))
    assert not problems, "\n".join(problems)


def test_kernel_modules_the_model_loads_exist():
    modules = find_modules({top: package_folder(top) for top in TOOLKIT_PACKAGES})
    assert {kernels for kernels, _, _ in kernel_modules().values()} <= set(modules)


def repository_python_files() -> list[Path]:
    """The .py files git tracks or would track here: ignored folders (.packages/, .carry/, build/) left out."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        skip = {".git", ".packages", "build"}
        return [p for p in sorted(REPO.rglob("*.py")) if not skip & set(p.relative_to(REPO).parts)]
    return [REPO / name for name in sorted(listed) if (REPO / name).is_file()]


def test_nothing_imports_a_folder_by_its_folder_name():
    paths = repository_python_files()
    problems = folder_name_imports(paths)
    assert not problems, "\n".join(problems)


def test_the_checks_name_the_module_and_the_import(tmp_path):
    for path, text in {
        "kernels/__init__.py": "",
        "kernels/ops.py": "from raven_layers.mixer import helper\n",
        "kernels/naive.py": "from raven_layers.mixer import reference\n",
        "layers/__init__.py": "",
        "layers/mixer.py": "from . import other\nfrom raven_kernels.naive import reference\n",
        "layers/other.py": "import raven_layers.mixer\n",
        "layers/train/__init__.py": "",
        "layers/train/loop.py": "",
        "layers/choice.py": "def fit():\n    from .train.loop import align\n",
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    roots = {"raven_kernels": tmp_path / "kernels", "raven_layers": tmp_path / "layers"}
    graph = import_graph(find_modules(roots), tmp_path)
    assert wrong_directions(graph) == [
        "kernels/ops.py:1: raven_kernels.ops imports raven_layers.mixer ('from raven_layers.mixer import helper'); "
        "raven_kernels may import nothing of the toolkit outside itself",
        "layers/mixer.py:2: raven_layers.mixer imports raven_kernels.naive ('from raven_kernels.naive import "
        "reference'), a reference or benchmark module, which imports the model package: only tests and other such "
        "modules may import it",
    ]
    rules = {"raven_layers.choice": (("raven_layers.train",), "train imports it")}
    assert forbidden_imports(graph, rules) == [
        "layers/choice.py:2: raven_layers.choice imports raven_layers.train.loop ('from .train.loop import align'); "
        "it may not: train imports it"
    ]
    assert sorted(cycles(graph)) == [
        "import cycle: raven_kernels.naive -> raven_layers.mixer (kernels/naive.py:1: 'from raven_layers.mixer import "
        "reference'); raven_layers.mixer -> raven_kernels.naive (layers/mixer.py:2: 'from raven_kernels.naive import "
        "reference')",
        "import cycle: raven_layers.mixer -> raven_layers.other (layers/mixer.py:1: 'from . import other'); "
        "raven_layers.other -> raven_layers.mixer (layers/other.py:1: 'import raven_layers.mixer')",
    ]
