"""The walls between the package's rooms, checked on the source.

Every import of every module of ``mlora_lab`` is read from its syntax tree — at the top level, inside
functions and under ``TYPE_CHECKING`` alike, since each is a dependency the day that code runs — and
the test fails on:

* an import circle between modules;
* the job side — ``job/`` (the torchrun process) and ``service/`` (what its rank 0 serves to Tinker
  clients) — importing ``lab/`` or the notebook's libraries (pandas, matplotlib, ipywidgets), or ``lab/``
  (the notebook and CLI process) importing ``job/``: the two meet only in the run directory;
* the engine (``lora/``, ``parallel/``, ``data``, ``optim``, ``memory``, ``sampling``, ``rl/``) importing
  ``validate/``, ``job/`` or ``lab/``;
* torch in the light contract (``spec/``, ``text``, ``sources``, ``search``, ``rundir`` but its tensor
  codec), which the notebook side reads without loading torch;
* a room of the lab importing a room of the lab that :data:`LAB_ROOMS` does not let it (the lab's own
  walls: a room imports only rooms below it);
* a private name (``_x``) imported from another module;
* a module over 800 lines or a class over 450.

``from a.b import c`` is an edge to the module ``a.b.c`` when there is one, else to ``a.b``. Importing a
submodule also runs its package's ``__init__``, but that is not counted as an edge: a package whose
``__init__`` re-exports its submodules, and submodules that import each other by their full names, is
the ordinary shape of a package, not a circle.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

from conftest import not_ours

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlora_lab"

ENGINE = (
    "mlora_lab.lora",
    "mlora_lab.parallel",
    "mlora_lab.data",
    "mlora_lab.optim",
    "mlora_lab.memory",
    "mlora_lab.sampling",
    "mlora_lab.rl",
)
LIGHT = (
    "mlora_lab.spec",
    "mlora_lab.text",
    "mlora_lab.sources",
    "mlora_lab.search",
    "mlora_lab.rundir",
)
LIGHT_EXCEPT = ("mlora_lab.rundir.checkpoint",)  # the tensor codec of checkpoints: safetensors, torch
JOB_SIDE = ("mlora_lab.job", "mlora_lab.service")  # processes started by torchrun
NOTEBOOK_LIBRARIES = ("pandas", "matplotlib", "ipywidgets", "ipympl", "IPython")


LAB_ROOMS: dict[str, tuple[str, ...]] = {
    # room of mlora_lab.lab -> the rooms of the lab it may import, bottom up (each only rooms above it here)
    "tables": (),  # DataFrames that show themselves fitted
    "plotting": (),  # how the lab draws
    "exports": (),  # adapters out: merged, GGUF, the Hub
    "slurm": (),  # what mlora_lab knows of Slurm: options, batch script, sbatch's reading, Slurm's answers
    "records": ("plotting",),  # what a run directory records: logs, series, trials, usage
    "launchers": ("records", "slurm"),  # the launcher seam, its engines (local, Slurm, Ray), liveness
    "dashboard": ("tables", "plotting", "exports", "records", "launchers"),  # the live view
    "runs": ("tables", "exports", "records", "launchers", "dashboard"),  # the handles: Run, ServedRun, ...
    "launch": ("records", "launchers", "runs"),  # ml.launch / resume / serve, by launcher name
    "sweeps": ("records", "launchers", "runs", "launch"),  # ml.sweep
    "evals": ("tables", "plotting", "records", "runs"),  # ml.evaluate, Evaluation, the eval table
    "compare": ("tables", "plotting", "records", "dashboard", "runs", "evals"),  # runs, summary, hparams, ...
    "forms": ("records", "runs", "launch"),  # TenantForm, JobBuilder
    "demo": (),  # mlora-lab demo's model and data
    "cli": (
        "tables",
        "exports",
        "records",
        "launchers",
        "runs",
        "launch",
        "sweeps",
        "evals",
        "compare",
        "demo",
    ),
}
"""The lab's rooms and what each may import of the others. The two crossings that go down are calls made
inside a function: ``Run.dashboard()`` (a handle opens its board) and ``SweepRun.dashboard()``."""
SEAM = "mlora_lab.lab.launchers.base"
"""The launcher seam's vocabulary (Launcher, EngineJob, LauncherError), which every room may speak: an
engine's room of knowledge (``slurm``) raises a LauncherError. It imports no room of the lab itself."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, *rooms: str) -> bool:
    return any(name == r or name.startswith(r + ".") for r in rooms)


@cache
def imports(name: str) -> tuple[tuple[str, tuple[str, ...], int, bool], ...]:
    """``(target module, names taken from it, line, at top level)`` for every import in module ``name``."""
    path = modules()[name]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, (), node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules():
                    out.append((sub, (), node.lineno, id(node) in top))
                else:
                    out.append((base, (a.name,), node.lineno, id(node) in top))
    return tuple(out)


def edges(name: str, top_only: bool = False) -> set[str]:
    return {
        t for t, _, _, at_top in imports(name) if t in modules() and t != name and (at_top or not top_only)
    }


def cycles() -> list[list[str]]:
    """The import circles (Tarjan's strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges(v)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(modules()):
        if v not in index:
            visit(v)
    return found


def violations(rule) -> list[str]:
    out = []
    for name in sorted(modules()):
        for target, names, line, _ in imports(name):
            why = rule(name, target, names)
            if why:
                out.append(f"{modules()[name].relative_to(ROOT)}:{line}: {why}")
    return out


def test_the_rooms_are_where_the_guide_says():
    names = set(modules())
    for room in (
        "mlora_lab.job",
        "mlora_lab.service",
        "mlora_lab.lab",
        "mlora_lab.validate",
        "mlora_lab.rundir",
        "mlora_lab.text",
    ):
        assert room in names, f"{room} is missing"
    for gone in (
        "mlora_lab.train",
        "mlora_lab.checkpointer",
        "mlora_lab.control_handler",
        "mlora_lab.search_job",
    ):
        assert gone not in names, f"{gone} should have moved into mlora_lab.job"
    # the generic loop in job/, its drivers (and their seam) in job/drivers/
    for driver in ("base", "files", "rl", "preference", "tinker", "tinker.driver", "tinker.job_service", "tinker.snapshots",
                   "tinker.saved_states", "tinker.sessions", "tinker.plan", "default"):  # fmt: skip
        assert f"mlora_lab.job.drivers.{driver}" in names, driver
    # the service's HTTP front: its Tinker routes by resource of the SDK, which app composes
    for module in ("app", "openai_api", "routes.base", "routes.sessions", "routes.training", "routes.weights",
                   "routes.sampling", "routes.rest"):  # fmt: skip
        assert f"mlora_lab.service.{module}" in names, module
    for gone in ("driver", "filedata", "rl", "service", "served", "snapshots", "saved_states"):
        assert f"mlora_lab.job.{gone}" not in names, (
            f"mlora_lab.job.{gone} should be in mlora_lab.job.drivers"
        )


DRIVERS = (
    "mlora_lab.job.drivers.files",
    "mlora_lab.job.drivers.rl",
    "mlora_lab.job.drivers.preference",
    "mlora_lab.job.drivers.tinker",
)
"""The drivers, each a module or a package: none imports another (the job's list composes them,
``mlora_lab.job.drivers.default``); they share only the seam, ``mlora_lab.job.drivers.base``."""


def lab_room(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["mlora_lab", "lab"] else None


def test_every_module_of_the_lab_is_in_a_named_room():
    loose = sorted({room for m in modules() if (room := lab_room(m)) and room not in LAB_ROOMS})
    assert loose == [], f"rooms of the lab that LAB_ROOMS does not name: {loose}"


def test_the_rooms_of_the_lab_import_only_the_rooms_below_them():
    def rule(name: str, target: str, names: tuple) -> str | None:
        mine, theirs = lab_room(name), lab_room(target)
        if mine and theirs and mine != theirs and theirs not in LAB_ROOMS.get(mine, ()) and target != SEAM:
            return f"lab.{mine} imports lab.{theirs} ({target})"
        return None

    assert violations(rule) == []
    assert not [t for t in edges(SEAM) if lab_room(t)], "the seam's vocabulary imports no room of the lab"


def test_drivers_never_import_each_other():
    def rule(name: str, target: str, names: tuple[str, ...]) -> str | None:
        mine = next((d for d in DRIVERS if within(name, d)), None)
        theirs = next((d for d in DRIVERS if within(target, d)), None)
        if mine and theirs and mine != theirs:
            return f"driver {mine} imports driver {theirs} ({target})"
        if mine and target == "mlora_lab.job.drivers.default":
            return f"driver {mine} imports the job's list of drivers"
        return None

    assert violations(rule) == []


def test_no_import_circles():
    assert cycles() == [], "import circles (every import counts, inside functions too)"


def test_the_job_and_the_lab_meet_only_in_the_run_directory():
    def rule(name: str, target: str, names: tuple) -> str | None:
        if within(name, *JOB_SIDE) and within(target, "mlora_lab.lab", *NOTEBOOK_LIBRARIES):
            return f"the job side module {name} imports {target}"
        if within(name, "mlora_lab.lab") and within(target, "mlora_lab.job"):
            return f"the lab imports {target}"
        return None

    assert violations(rule) == []


def test_the_engine_imports_nothing_above_it():
    def rule(name: str, target: str, names: tuple) -> str | None:
        if within(name, *ENGINE) and within(target, "mlora_lab.validate", "mlora_lab.job", "mlora_lab.lab"):
            return f"the engine module {name} imports {target}"
        return None

    assert violations(rule) == []


def test_the_light_contract_loads_no_torch():
    """No module of the light contract imports torch itself, nor reaches it through the top-level imports
    of the modules it imports (a function-level import of model code is paid only when called)."""
    light = [m for m in modules() if within(m, *LIGHT) and not within(m, *LIGHT_EXCEPT)]
    heavy = []
    for start in light:
        seen, todo, path = {start}, [start], {start: [start]}
        while todo:
            m = todo.pop()
            for target, _, line, at_top in imports(m):
                if within(target, "torch", "transformers", "peft", "safetensors.torch") and (
                    at_top or m == start
                ):
                    heavy.append(f"{start} loads {target} via {' -> '.join(path[m])} (line {line})")
                if (
                    target in modules()
                    and at_top
                    and target not in seen
                    and not within(target, *LIGHT_EXCEPT)
                ):
                    seen.add(target)
                    path[target] = [*path[m], target]
                    todo.append(target)
    assert heavy == []


def test_no_private_name_is_imported_from_another_module():
    def rule(name: str, target: str, names: tuple) -> str | None:
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if within(target, "mlora_lab") and target != name and private:
            return f"imports {', '.join(private)} from {target}"
        return None

    assert violations(rule) == []


def run_python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_importing_the_run_directory_protocol_loads_no_torch():
    loaded = run_python(
        "import sys, mlora_lab.rundir, mlora_lab.spec.job, mlora_lab.spec.fields, mlora_lab.spec.parts, "
        "mlora_lab.text, mlora_lab.search; "
        "print(sorted(m for m in ('torch', 'transformers', 'pandas') if m in sys.modules))"
    )
    assert loaded == "[]"


def test_a_training_process_loads_no_notebook_library_and_no_service_library():
    """Nor the HTTP server and the tinker SDK (1.4 s of every job's start): only a job that serves loads them."""
    loaded = run_python(
        "import json, sys, mlora_lab.job.__main__; "
        f"print(json.dumps(sorted(m for m in {(*NOTEBOOK_LIBRARIES, 'tinker', 'starlette', 'uvicorn')!r} "
        "if m in sys.modules)))"
    )
    assert not_ours(json.loads(loaded)) == []


MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 450


def test_no_module_over_800_lines_and_no_class_over_450():
    """Rooms stay small enough to read: a module that outgrows 800 lines, or a class 450, is cut along
    a seam (a part built with what it needs, not holding its owner) before it grows further."""
    big = []
    for name, path in modules().items():
        source = path.read_text(encoding="utf-8")
        if (n := len(source.splitlines())) > MAX_MODULE_LINES:
            big.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                big.append(f"{name}.{node.name}: a class of {n} lines")
    assert big == []


TINKER_DRIVER = "mlora_lab.job.drivers.tinker"
MAX_TINKER_CLASS_LINES = 300


def test_no_class_of_the_tinker_driver_over_300_lines():
    """The service driver composes parts (sessions, the request plan, saved states, snapshots), each built
    with what it needs: a part that outgrows 300 lines is cut again, so that the driver has room to grow
    under the house's cap rather than meet it."""
    big = []
    for name, path in modules().items():
        if not within(name, TINKER_DRIVER):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            n = node.end_lineno - node.lineno + 1 if isinstance(node, ast.ClassDef) else 0
            if n > MAX_TINKER_CLASS_LINES:
                big.append(f"{name}.{node.name}: a class of {n} lines")
    assert big == []


def test_no_tracked_file_names_a_path_of_a_development_machine():
    """Docs and code cite the SDK, public docs or the repository itself, never a notes file or checkout on
    someone's machine (a home folder, the lab's work folders): such a path means nothing to a reader."""
    import re
    import subprocess

    home = "/" + "home/[A-Za-z0-9_.-]+/"  # (split, so that this file does not match itself)
    pattern = re.compile(
        "|".join(
            [
                "/" + r"work/(?:main|notes|shared|\.library|\.mirror)\b",
                home,
                "/" + "Users/[A-Za-z]",
                "/" + "root/",
                r"[A-Z]:\\" + r"Users\\",
            ]
        )
    )
    root = Path(__file__).resolve().parents[1]
    files = subprocess.run(
        ["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for name in files:
        try:
            text = (root / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        found += [
            f"{name}:{i}: {m.group(0)}"
            for i, line in enumerate(text.splitlines(), 1)
            for m in [pattern.search(line)]
            if m
        ]
    assert not found, "paths of a development machine:\n" + "\n".join(found)
