"""The package's imports point one way: shared modules <- plan <- train <- inference, merge <- commands <- cli.

Every import is counted, also those inside functions (a lazy import still couples two modules); only imports
under ``if TYPE_CHECKING:`` (never executed) are left out. A lower layer importing a higher one fails, and
so does any cycle between modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "finetune"

#: Layer of each module, by its dotted name's prefix (longest match wins).
LAYERS = {
    "finetune": 0,  # shared: errors, units, versions, spec, and the packages recipe, model, objectives, storage
    "finetune.plan": 1,
    "finetune.train": 2,
    "finetune.inference": 3,  # the one inference loader (the run reader, finetune.storage.rundir, is shared)
    "finetune.merge": 3,  # the streaming fold, which `finetune export` reuses
    "finetune.commands": 4,  # one module per verb
    "finetune.cli": 5,
    "finetune.__main__": 5,
}
#: The commands' modules (layer 4): none imports another's.
COMMANDS = ("finetune.commands",)


def module_name(path: Path) -> str:
    """Dotted name of a file of the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    """The layer of a module of the package."""
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports anywhere (module level or inside functions)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("finetune"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                base = ".".join(parent[: len(parent) - node.level + 1] + ([base] if base else []))
            if not base.startswith("finetune"):
                continue
            for alias in node.names:  # `from finetune.train import checkpoint` imports a module
                sub = f"{base}.{alias.name}"
                found.add(sub if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").is_file() else base)
    found.discard(me)
    return found


def graph() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports."""
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_imports_point_one_way() -> None:
    upward = sorted(
        f"{mod} (layer {layer(mod)}) imports {dep} (layer {layer(dep)})"
        for mod, deps in graph().items()
        for dep in deps
        if layer(dep) > layer(mod)
    )
    assert upward == []


def _command_of(module: str) -> str | None:
    """The command a module belongs to: ``finetune.commands.chat``, ``finetune.commands.serve``... (None: no command)."""
    for c in COMMANDS:
        if module == c or module.startswith(c + "."):
            return c if c != "finetune.commands" else ".".join(module.split(".")[:3])
    return None


def test_no_command_imports_another() -> None:
    """What two commands need lives below them (the run reader, the loader, the fold), never in one of them."""
    across = sorted(
        f"{mod} imports {dep}"
        for mod, deps in graph().items()
        for dep in deps
        if _command_of(mod) is not None and _command_of(dep) not in (None, _command_of(mod))
        and dep != "finetune.commands"
    )
    assert across == []
    assert _command_of("finetune.commands.serve") == "finetune.commands.serve" != _command_of("finetune.commands.chat")


def test_no_import_cycles() -> None:
    g = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(g.get(m, ())):
            if dep not in g:
                continue
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert cycles == []


def test_the_checker_sees_function_local_and_relative_imports(tmp_path: Path) -> None:
    """The walk would catch an upward import hidden in a function."""
    assert layer("finetune.plan.flowchart") == 1 and layer("finetune.recipe.schema") == 0 and layer("finetune.cli") == 5
    assert layer("finetune.storage.rundir") == 0 and layer("finetune.inference") == 3 and layer("finetune.commands.data") == 4
    deps = imports_of(PACKAGE / "train" / "trainer.py")
    assert "finetune.train.gradients" in deps and "finetune.plan.types" in deps
    assert "finetune.commands.run" in imports_of(PACKAGE / "cli.py")  # imported inside the `run` command


def test_the_top_level_holds_at_most_twelve_modules() -> None:
    """Everything else lives in a package named after its concern (commands, recipe, model, objectives, storage,
    plan, train)."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert packages == ["commands", "model", "objectives", "plan", "recipe", "storage", "train"]


def test_no_module_imports_another_modules_private_names() -> None:
    """What two modules share is public (no leading underscore) in the one that defines it."""
    private = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune"):
                private += [
                    f"{module_name(path)} imports {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert private == []


def test_train_is_grouped_by_concern() -> None:
    """train/ holds the loop's own modules at its top and the rest in its packages (parallel, data, ...)."""
    flat = sorted(p.stem for p in (PACKAGE / "train").glob("*.py") if p.stem != "__init__")
    packages = sorted(p.name for p in (PACKAGE / "train").iterdir() if (p / "__init__.py").is_file())
    assert packages == ["checkpoint", "data", "metrics", "model", "parallel", "runtime"]
    assert len(flat) <= 12, flat
    assert module_name(PACKAGE / "train" / "parallel" / "layout.py") == "finetune.train.parallel.layout"


def test_importing_finetune_changes_no_logging_or_warnings_setting() -> None:
    """No import-time side effects: importing the package and its CLI (in a fresh interpreter) leaves the warning
    filters and the loggers' levels as they were; a command's start silences the libraries' notes."""
    code = (
        "import logging, warnings\n"
        "filters = list(warnings.filters)\n"
        "import finetune, finetune.cli, finetune.versions\n"
        "assert warnings.filters == filters, [f for f in warnings.filters if f not in filters]\n"
        "assert logging.getLogger('bitsandbytes.backends.cpu.ops').level == logging.NOTSET\n"
        "from typer.testing import CliRunner\n"
        "assert CliRunner().invoke(finetune.cli.app, ['recipes', 'ls']).exit_code == 0\n"
        "assert logging.getLogger('bitsandbytes.backends.cpu.ops').level == logging.ERROR\n"
        "assert any(f[1] is not None and f[1].pattern == '.*is_gradient_checkpointing.*' for f in warnings.filters)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
