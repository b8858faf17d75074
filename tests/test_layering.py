"""The layout's rules, checked: which imports load what, no import cycles (function-local imports included),
model code free of infrastructure, a package import with no side effects, a docstring on every module. Size is
guidance (docs/layout.md), not a test."""

import ast
import re
import subprocess
import sys
from pathlib import Path

from kernels.triton import host, shared

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("mhar_titan", "kernels", "data", "benchmarks", "chaos")
# Model code (torchtitan's models/llama3/model): parallelize.py is the model's infrastructure, apart.
MODEL_CODE = (
    "mhar_titan.model.args",
    "mhar_titan.model.hf_config",
    "mhar_titan.model.model",
    "mhar_titan.model.state_dict_adapter",
)
INFRASTRUCTURE = (
    "mhar_titan.components",
    "mhar_titan.hf",
    "mhar_titan.compare",
    "mhar_titan.eval",
    "mhar_titan.trainer",
    "mhar_titan.train_spec",
    "mhar_titan.config",
    "mhar_titan.cpu",
    "data",
    "benchmarks",
    "torchtitan.train",
    "torchtitan.components",
    "torch.distributed",
)


def _modules() -> dict[str, Path]:
    out = {"train_cpt": REPO / "train_cpt.py"}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Project modules `name` imports anywhere in its body (function-local imports too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != name}


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_kernels_load_nothing_of_the_project_or_torchtitan():
    loaded = _loaded_after("import kernels")
    assert not [m for m in loaded if m.split(".")[0] in ("mhar_titan", "torchtitan", "data", "benchmarks")]


def test_the_comparison_cli_loads_no_triton_and_no_trainer():
    loaded = _loaded_after("import mhar_titan.compare.__main__")
    assert not [
        m for m in loaded if m.split(".")[0] in ("triton", "kernels") or m in ("mhar_titan.trainer", "torchtitan.train")
    ]


def test_importing_the_package_registers_nothing():
    loaded = _loaded_after("import mhar_titan")
    assert not [m for m in loaded if m.startswith(("mhar_titan.", "torchtitan"))]
    for path in [REPO / "mhar_titan" / "__init__.py", *(REPO / "mhar_titan").glob("*/__init__.py")]:
        body = ast.parse(path.read_text()).body
        assert len(body) == 1 and isinstance(body[0].value, ast.Constant), f"{path}: more than a docstring"


def test_no_import_cycles_anywhere():
    known = _modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert len(graph) > 60  # the walk saw the project, not an empty tree


# Layers, bottom up, and what each may import of the project (function-local imports too): the data package
# nothing of mhar_titan; the model (parallelize.py too) no components; the components no tool or entry point
# above them (hf, compare, eval, preflight, the trainer, the config). Whatever both need lives in the lower one.
MAY_IMPORT = {
    "data": ("data", "kernels"),
    "mhar_titan.model": ("mhar_titan.model", "kernels"),
    "mhar_titan.components": (
        "mhar_titan.components",
        "mhar_titan.model",
        "mhar_titan.titan_compat",
        "data",
        "kernels",
    ),
}


def test_no_import_runs_back_up_the_layers():
    known = _modules()
    upward = []
    for layer, allowed in MAY_IMPORT.items():
        for name, path in known.items():
            if name == layer or name.startswith(layer + "."):
                bad = [
                    m
                    for m in sorted(_imports(name, path, known))
                    if m != "mhar_titan" and not any(m == a or m.startswith(a + ".") for a in allowed)
                ]
                upward += [f"{name} imports {m}" for m in bad]
    assert not upward, upward


def _defines_a_hook(path: Path) -> bool:
    bases = [b for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef) for b in node.bases]
    return any(isinstance(b, ast.Name) and b.id == "Hook" for b in bases)


def test_the_trainer_imports_none_of_the_concerns_it_hosts():
    """Each concern is a hook (components/hooks.py) that train_spec.build_hooks lists: the trainer imports the protocol
    and the loop's own machinery, never a module that defines a hook."""
    known = _modules()
    concerns = {name for name, path in known.items() if _defines_a_hook(path)}
    assert len(concerns) >= 10 and "mhar_titan.components.ema" in concerns  # the walk found the job's hooks
    assert not _imports("mhar_titan.trainer", known["mhar_titan.trainer"], known) & concerns


CHECKPOINT = "mhar_titan.components.checkpoint"
TOOLS = ("mhar_titan.eval", "mhar_titan.hf", "mhar_titan.preflight", "mhar_titan.compare", "benchmarks", "chaos")
# What the tools use of the checkpoint package besides its layout, none of it torchtitan-bound: the checksums (a step
# verified, or a test step's written) and the threaded DCP reader (hf export reads a step with it).
TOOLS_MAY_USE = (f"{CHECKPOINT}.layout", f"{CHECKPOINT}.checksums", f"{CHECKPOINT}.dcp_io")
# Benchmarks (and the soak) that drive a module of the package itself: the store's copy, the seams' names.
BENCHMARKS_DRIVE = {
    "benchmarks.bench_checkpoint_s3": f"{CHECKPOINT}.remote",
    "benchmarks.resume_spread": f"{CHECKPOINT}.testing",
    "chaos.soak": f"{CHECKPOINT}.testing",
}


def test_the_checkpoint_layout_loads_no_torch_and_no_torchtitan():
    loaded = _loaded_after(f"import {CHECKPOINT}.layout")
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "torchtitan")]
    body = ast.parse((REPO / "mhar_titan" / "components" / "checkpoint" / "__init__.py").read_text()).body
    assert len(body) == 1 and isinstance(body[0].value, ast.Constant), "the package's __init__: more than a docstring"


def test_the_tools_use_the_checkpoint_layout_not_the_manager():
    known = _modules()
    used = []
    for name, path in known.items():
        if any(name == tool or name.startswith(tool + ".") for tool in TOOLS):
            allowed = (CHECKPOINT, *TOOLS_MAY_USE, BENCHMARKS_DRIVE.get(name))
            used += [
                f"{name} imports {m}"
                for m in sorted(_imports(name, path, known))
                if m.startswith(CHECKPOINT + ".") and m not in allowed
            ]
    assert not used, used
    loaded = _loaded_after("; ".join(f"import {m}" for m in TOOLS_MAY_USE))
    assert not [m for m in loaded if m.split(".")[0] == "torchtitan" or m == f"{CHECKPOINT}.manager"]
    assert f"{CHECKPOINT}.manager" not in BENCHMARKS_DRIVE.values()


def test_model_code_imports_no_infrastructure():
    known = _modules()
    for name in MODEL_CODE:
        tree = ast.parse(known[name].read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            bad = [n for n in names if any(n == p or n.startswith(p + ".") for p in INFRASTRUCTURE)]
            assert not bad, f"{name} imports {bad}"


def test_every_module_says_what_it_holds():
    for path in _modules().values():
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.relative_to(REPO)}: no docstring"


def test_one_atomic_write_one_check_of_a_writer_and_one_all_gather_of_python_objects():
    def users(text: str) -> list[str]:
        return sorted(
            str(path.relative_to(REPO))
            for name, path in _modules().items()
            if not name.startswith("benchmarks") and text in path.read_text()
        )

    assert users("os.replace(") == ["data/atomic.py"]  # below mhar_titan and data both
    # one way to tell a writer that is gone: its temporary siblings (a signal sent, as signals.py does, is no question)
    assert [u for u in users("os.kill(") if re.search(r"os\.kill\(\w+, 0\)", (REPO / u).read_text())] == [
        "data/atomic.py"
    ]
    assert users("all_gather_object(") == ["data/collectives.py"]


def test_no_version_tags_in_code_comments():
    tagged = []
    for path in _modules().values():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "#" in line and re.search(r"\bv1[0-9]\b", line.split("#", 1)[1]):
                tagged.append(f"{path.relative_to(REPO)}:{number}")
    assert not tagged, tagged


def test_the_kernels_package_opens_with_where_the_backward_runs():
    doc = ast.get_docstring(ast.parse((REPO / "kernels" / "triton" / "__init__.py").read_text()))
    for name in ("backward_stats", "backward_mix", "custom_op_backward"):
        assert f"host.{name}" in doc and callable(getattr(host, name))
    assert "shared.backward_mix_shared" in doc and callable(shared.backward_mix_shared)
    assert "autograd._Route.backward" in doc
