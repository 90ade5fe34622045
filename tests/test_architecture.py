"""The package's shape, checked on its source: layers that point one way, no long parameter lists,
no module past STYLE's 600 lines (docs/ARCHITECTURE.md draws the layers), and docs/ARCHITECTURE.md's
map naming every module, one line each."""
import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "mugrpo"

LAYERS = [
    {"registry", "errors", "seeds", "faults", "run_dir", "hardware", "stopping", "heap"},
    {"algo"},
    {"models", "rollout"},
    {"config"},
    {"observability"},
    {"evaluation"},
    {"kit"},
    {"stages"},
    {"training", "warmstart"},
    {"api", "cli", "pipeline", "serve", "__main__", "__init__"},
]
"""Bottom to top: a module may import its own layer's and lower layers' modules only (lazily or not)."""

PUBLIC_ENTRY_POINTS = {("api.py", "train")}
"""``mugrpo.train``: TRL-style keyword-only options a user passes by name (config, preset, reward_funcs,
reward_weights, train_dataset, eval_dataset, run_dir, tools, environment, resume, replay)."""


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def _layer(unit: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"mugrpo.{unit} is in no layer of tests/test_architecture.py LAYERS (and docs/ARCHITECTURE.md)")


def _unit(dotted: str) -> str:
    """The layer unit of ``mugrpo.x.y``: the sub-package or top-level module ``x``."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks: imports for annotations only, never run."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            inside |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return inside


def _upward(here: str, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, target) of every import in ``tree`` (a module of layer unit ``here``) of a higher layer;
    imports for type annotations only (``if TYPE_CHECKING:``) do not count."""
    out = []
    skip = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mugrpo"):
            targets = [node.module] if node.module != "mugrpo" else [f"mugrpo.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("mugrpo.")]
        out += [(node.lineno, t) for t in targets if _layer(_unit(t)) > _layer(here)]
    return out


def test_every_import_points_down_the_layers():
    upward = []
    for path, tree in _modules():
        here = _unit(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        upward += [f"{path.relative_to(PACKAGE)}:{line} imports {target}" for line, target in _upward(here, tree)]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_layer_check_sees_upward_imports_lazy_ones_too():
    source = "from mugrpo import seeds\ndef f():\n    from mugrpo.training import trainer\n    import mugrpo.config\n"
    assert _upward("rollout", ast.parse(source)) == [(3, "mugrpo.training"), (4, "mugrpo.config")]
    assert _upward("training", ast.parse(source)) == []


def test_the_layer_check_ignores_imports_for_annotations_only():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mugrpo.stages.data import StageData\n"
              "from mugrpo.training import trainer\n")
    assert _upward("kit", ast.parse(source)) == [(4, "mugrpo.training")]


@pytest.mark.parametrize("limit", [8])
def test_no_function_takes_more_than_eight_parameters(limit):
    long = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            if names and names[0] in ("self", "cls"):
                names = names[1:]
            count = len(names) + bool(a.vararg) + bool(a.kwarg)
            if count > limit and (str(path.relative_to(PACKAGE)), node.name) not in PUBLIC_ENTRY_POINTS:
                long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} takes {count}")
    assert not long, "functions with more than 8 parameters (pass an object):\n" + "\n".join(long)


def test_no_module_is_over_600_lines():
    big = [f"{p.relative_to(PACKAGE)}: {n}" for p in sorted(PACKAGE.rglob("*.py"))
           if (n := len(p.read_text().splitlines())) > 600]
    assert not big, f"modules over STYLE's 600 lines: {big}"


def _package_cycles() -> list[str]:
    """Modules that import their own package while the package's ``__init__`` imports them: a cycle
    that only works by import order (``from mugrpo.config import schema`` inside ``config/io.py``)."""
    out = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        pkg = ".".join(init.parent.relative_to(PACKAGE.parent).parts)
        exported = {node.module for node in ast.walk(ast.parse(init.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(pkg + ".")}
        for module in exported:
            path = PACKAGE.parent / (module.replace(".", "/") + ".py")
            if not path.is_file():
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == pkg:
                    out.append(f"{module} (line {node.lineno}) imports {pkg}, whose __init__ imports it")
    return out


def test_no_module_imports_the_package_that_imports_it():
    cycles = _package_cycles()
    assert not cycles, "package import cycles:\n" + "\n".join(cycles)


def _imported_by_tests() -> set[str]:
    """Every ``mugrpo`` module a test file imports (``import mugrpo.x.y``, ``from mugrpo.x.y import ...``
    or ``from mugrpo.x import y``)."""
    seen = set()
    for path in (PACKAGE.parent / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mugrpo"):
                seen |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                seen |= {a.name for a in node.names}
    return seen


def test_every_module_has_a_test_that_imports_it():
    modules = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts) for p in PACKAGE.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    untested = sorted(modules - _imported_by_tests())
    assert not untested, "modules no test imports (add tests/<package>/test_<module>.py):\n" + "\n".join(untested)


MAP_LINE = re.compile(r"^- `([\w/]+\.py)`: \S")
"""A module's line in docs/ARCHITECTURE.md's map: ``- `mugrpo/algo/veto.py`: what it holds``."""


def _holds_code(path: Path) -> bool:
    """Whether a module has a statement besides its docstring (an ``__init__.py`` that is only a
    docstring, or empty, needs no line in the map)."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return bool(body)


def _summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or "what it holds"
    return doc.split("\n")[0].rstrip(".")


def _map_problems(package: Path, doc: str) -> list[str]:
    """What is wrong with the map in ``doc`` (the text of docs/ARCHITECTURE.md) for ``package``: a module
    without its line (the message gives the line to add and where), a line naming no module, a line
    twice, or a line under another folder's heading (``### mugrpo/algo/ ...``)."""
    root = package.parent
    modules = {p.relative_to(root).as_posix(): p for p in sorted(package.rglob("*.py"))
               if p.name != "__init__.py" or _holds_code(p)}
    named, problems, heading = [], [], None
    for line in doc.splitlines():
        if line.startswith("### "):
            heading = line[4:].split()[0]
        elif m := MAP_LINE.match(line):
            path = m.group(1)
            named.append(path)
            folder = path.rsplit("/", 1)[0] + "/"
            if heading != folder:
                problems.append(f"{path}: its line is under `### {heading}`; move it under `### {folder}`")
    for path in sorted(set(p for p in named if named.count(p) > 1)):
        problems.append(f"{path}: named on {named.count(path)} lines; keep one")
    for path in sorted(set(named) - set(modules)):
        if not (root / path).is_file():
            problems.append(f"{path}: no such module; remove its line")
    for path in sorted(set(modules) - set(named)):
        folder = path.rsplit("/", 1)[0] + "/"
        problems.append(f"{path}: no line; add this line under `### {folder}` (a new heading if there is none):\n"
                        f"    - `{path}`: {_summary(modules[path])}")
    return problems


def test_the_architecture_map_names_every_module_and_only_modules():
    doc = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    problems = _map_problems(PACKAGE, doc)
    assert not problems, "docs/ARCHITECTURE.md's map of modules is out of date:\n" + "\n".join(problems)


def test_the_map_check_names_the_missing_line_and_the_stale_one(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text('"""Module a."""\nX = 1\n')
    (package / "sub" / "__init__.py").write_text('"""Only a docstring: needs no line."""\n')
    (package / "sub" / "new.py").write_text('"""What the new module holds.\n\nMore."""\n')
    doc = "### pkg/\n- `pkg/a.py`: module a\n### pkg/sub/\n- `pkg/sub/gone.py`: removed\n- `pkg/a.py`: again\n"
    assert _map_problems(package, doc) == [
        "pkg/a.py: its line is under `### pkg/sub/`; move it under `### pkg/`",
        "pkg/a.py: named on 2 lines; keep one",
        "pkg/sub/gone.py: no such module; remove its line",
        "pkg/sub/new.py: no line; add this line under `### pkg/sub/` (a new heading if there is none):\n"
        "    - `pkg/sub/new.py`: What the new module holds"]
    assert _map_problems(package, "### pkg/\n- `pkg/a.py`: module a\n### pkg/sub/\n- `pkg/sub/new.py`: new\n") == []
