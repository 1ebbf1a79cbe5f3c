"""The public API: every exported name exists, is documented, and imports do no work."""
import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import memfit


def test_every_exported_name_exists_and_is_documented():
    assert len(set(memfit.__all__)) == len(memfit.__all__)
    for name in memfit.__all__:
        obj = getattr(memfit, name)
        assert obj.__doc__ and len(obj.__doc__.strip()) > 20, f"memfit.{name} has no docstring"


def test_version_has_one_source():
    text = open(memfit.__file__.replace("__init__.py", "../../pyproject.toml")).read()
    assert 'dynamic = ["version"]' in text and 'build-backend = "flit_core.buildapi"' in text  # flit reads __version__
    assert "version = \"" not in text           # no literal version beside __version__


def test_import_is_cheap_and_has_no_side_effects():
    code = "import sys; import memfit; print('sklearn' in sys.modules, 'matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": ":".join(sys.path)})
    sklearn, mpl = out.stdout.split()
    assert sklearn == "False" and mpl == "False"      # optional dependencies load only when used


def test_submodules_are_documented():
    """Every module of the package says what it holds (found by walking the source, so a new one is checked too)."""
    undocumented = []
    for name in all_modules():
        if name == "memfit.__main__":            # importing it runs the command line
            continue
        m = importlib.import_module(name)
        if not (m.__doc__ and len(m.__doc__) > 40):
            undocumented.append(name)
    assert not undocumented, undocumented


# ---- the layout: imports flow one way, no module shadowed, one import path per public name ----------------------
SRC = Path(memfit.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> list[str]:
    return sorted(module_name(p) for p in SRC.rglob("*.py"))


def imported_modules(path: Path, name: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth (function-level ones too),
    relative imports resolved against its module `name` (default: from its path); `from a import b` yields
    both a and a.b (b may be a module); `importlib.import_module("...")` with a literal name counts as well."""
    tree = ast.parse(path.read_text(), str(path))
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value))
    return out


def test_the_library_never_imports_the_command_line():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if module_name(path).startswith("memfit.cli") or path.name == "__main__.py":    # `python -m memfit` is the CLI
            continue
        found += [f"{path.relative_to(SRC.parent)}:{line} imports {name}" for line, name in imported_modules(path)
                  if name == "memfit.cli" or name.startswith("memfit.cli.")]
    assert not found, "the library imports the command line (memfit.cli sits on top of it):\n" + "\n".join(found)


def test_the_import_scan_sees_function_level_and_relative_imports(tmp_path):
    """The scan above sees the ways an import of memfit.cli can hide."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from memfit.cli import options\n"
                     "def g():\n    from ..cli.data import parse\n"
                     "def h():\n    import importlib; importlib.import_module('memfit.cli.demo')\n")
    names = [n for _, n in imported_modules(probe, "memfit.loading.probe")]
    assert {"memfit.cli.options", "memfit.cli.data", "memfit.cli.demo"} <= set(names), names


@pytest.mark.parametrize("name", [n for n in all_modules() if "." in n and n != "memfit.__main__"])  # runs the CLI
def test_no_function_shadows_a_module(name):
    """memfit.X (and memfit.X.Y) is the module X once imported: no function or object of that name hides it."""
    module = importlib.import_module(name)
    parent, _, child = name.rpartition(".")
    found = getattr(importlib.import_module(parent), child)
    assert found is module, f"{parent}.{child} is {type(found).__name__} {found!r}, not the module {name}"


def test_each_public_name_has_one_import_path():
    """A name of memfit.__all__ is not exported again by a subpackage (memfit.planner.plan beside memfit.plan)."""
    public = set(memfit.__all__)
    twice = []
    for name in all_modules():
        if not (SRC.parent / name.replace(".", "/") / "__init__.py").exists() or name == "memfit":
            continue
        pkg = importlib.import_module(name)
        exported = set(getattr(pkg, "__all__", ())) | {k for k, v in vars(pkg).items()
                                                        if not k.startswith("_") and not inspect.ismodule(v)}
        twice += [f"{name}.{k}" for k in sorted(exported & public)
                  if not inspect.ismodule(getattr(memfit, k))]
    assert not twice, f"also exported beside memfit.*: {twice}; import them from memfit only"


def _graph() -> dict[str, set[str]]:
    """Module -> the memfit modules it imports (at any depth), a module's own package left out."""
    mods = set(all_modules())
    edges = {}
    for path in SRC.rglob("*.py"):
        name = module_name(path)
        found = {n for _, n in imported_modules(path) if n in mods and n != name}
        edges[name] = {n for n in found if not name.startswith(n + ".")}
    return edges


def test_there_are_no_import_circles():
    """Imports flow one way (issue 35 found five circles): a depth-first search finds no module that imports, through
    any chain, itself. `memfit/__init__` and a package's own `__init__` re-exporting its modules are left out."""
    edges = {m: {n for n in e if n != "memfit"} for m, e in _graph().items() if m != "memfit"}
    state, circles = {}, []

    def visit(m, path):
        state[m] = 1
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                circles.append(" -> ".join(path[path.index(n):] + [n]))
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2
    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(circles[:10])


def test_the_layers_point_down():
    """`memfit.device` (the allocator, real measurements, torch's private names) imports nothing else of memfit; the
    engine (`memfit.memory`) never imports the planner, its consumer."""
    up = [f"{m} imports {n}" for m, e in _graph().items() for n in sorted(e)
          if (m.startswith("memfit.device") and not n.startswith("memfit.device"))
          or (m.startswith("memfit.memory") and n.startswith("memfit.planner"))]
    assert not up, "\n".join(up)


def test_no_module_is_over_450_lines():
    long = {module_name(p): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_the_front_door_is_small_and_moved_names_still_resolve_with_a_pointer():
    """At most 15 names on `memfit` (issue 35: 36 were there); a name that moved resolves from its new home, with a
    DeprecationWarning saying where."""
    assert len(memfit.__all__) <= 15, memfit.__all__
    for name, home in memfit._MOVED.items():
        with pytest.warns(DeprecationWarning, match=f"memfit.{name} moved to {home}.{name}"):
            obj = getattr(memfit, name)
        assert obj is getattr(importlib.import_module(home), name)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        getattr(memfit, "nonexistent")  # noqa: B009  (the attribute access is the test)


# ---- private torch names: in memfit/device/torch_private.py only -----------------------------------------------------
TORCH_PRIVATE = SRC / "device" / "torch_private.py"
# private attributes set per instance or on classes not read below: FSDP2's state, groups and params, DDP's hooks, a
# DTensor's shard, DTensor's sharding lock, a compiled module's original, fx's patcher
_INSTANCE_PRIVATES = {"_orig_mod", "_get_fsdp_state", "_fsdp_param_groups", "_is_hsdp", "_comm_hooks", "_orig_size",
                      "_sharded_param_data", "_get_ddp_logging_data", "_local_tensor", "_fake_mode_lock", "_Patcher",
                      "_modules", "_parameters", "_buffers"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def torch_private_attributes() -> set[str]:
    """Private attribute names of the torch objects memfit handles (read off them, so one torch adds is seen too)."""
    import torch
    x = torch.ones(1, requires_grad=True)
    objects = [x, torch.UntypedStorage(1), torch.nn.Linear(1, 1), torch.ops.aten.add.Tensor, torch.ops.aten.add,
               (x * 2).grad_fn, torch.fx.Graph(), torch.fx.Node, torch.fx.GraphModule, torch.Generator(),
               torch.nn.parallel.DistributedDataParallel, torch.ops.aten.add.Tensor._schema]
    return _INSTANCE_PRIVATES | {n for o in objects for n in {*dir(o), *getattr(o, "__dict__", ())} if _is_private(n)}


def _dotted(node) -> list[str] | None:
    """["torch", "_C", "_nn"] for `torch._C._nn`; None where the chain does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


_BY_NAME = ("getattr", "hasattr", "setattr", "delattr")


def private_torch_names(path: Path, attributes: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each private torch name the file's code uses: an import of a private torch module or name
    (`torch._dynamo`, `from torch.utils import _pytree`), an attribute chain from `torch` through a private part
    (`torch._C._nn`; ATen op names `torch.ops.aten._unsafe_view` are the dispatcher's, not Python's API), a private
    attribute of a torch object (`t._version`, `op._schema`; on `self`/`cls` it is the class's own), by name in
    getattr/hasattr/setattr/delattr too. Docstrings and comments are not code."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names
                    if a.name.split(".")[0] == "torch" and any(map(_is_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            out += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                    if any(map(_is_private, [*node.module.split("."), a.name]))]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain = _dotted(node)
            if chain and chain[0] == "torch":
                if chain[1:2] != ["ops"]:
                    out.append((node.lineno, ".".join(chain)))
            elif node.attr in attributes and getattr(node.value, "id", None) not in ("self", "cls"):
                out.append((node.lineno, f".{node.attr}"))
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in _BY_NAME and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in attributes):
            out.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return out


def test_private_torch_names_are_named_in_torch_private_only():
    """Issue 35: 28 modules named private torch APIs; each is now re-exported or wrapped in
    `memfit.device.torch_private`, where tests/device/test_torch_private.py checks it against the torch installed."""
    attributes = torch_private_attributes()
    found = [f"{path.relative_to(SRC.parent)}:{line}: {what}"
             for path in sorted(SRC.rglob("*.py")) if path != TORCH_PRIVATE
             for line, what in sorted(set(private_torch_names(path, attributes)))]
    assert not found, ("private torch names outside memfit/device/torch_private.py (add them there, with a test in "
                       "tests/device/test_torch_private.py):\n" + "\n".join(found))


def test_the_private_name_scan_sees_every_form_and_nothing_else(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch\nimport torch._dynamo\nfrom torch.utils import _pytree\nfrom torch._ops import OpOverload\n"
        "def f(t, op, m, self):\n"
        "    from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "    a = torch._C._nn.gelu\n    b = torch.nn.modules.batchnorm._BatchNorm\n    c = t._version + op._schema\n"
        "    d = getattr(op, '_schema', None), hasattr(m, '_get_ddp_logging_data')\n    m._modules['x'] = None\n"
        "    ok = torch.ops.aten._unsafe_view.default, torch.__version__, self._version, t._own, torch.nn.Linear\n")
    found = {what for _, what in private_torch_names(probe, torch_private_attributes())}
    assert found == {"import torch._dynamo", "from torch.utils import _pytree", "from torch._ops import OpOverload",
                     "from torch._subclasses.fake_tensor import FakeTensorMode", "torch._C._nn", "torch._C",
                     "torch.nn.modules.batchnorm._BatchNorm", "._version", "._schema", "getattr(..., '_schema')",
                     "hasattr(..., '_get_ddp_logging_data')", "._modules"}, found
