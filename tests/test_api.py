"""The public API: every exported name exists, is documented, and imports do no work."""
import importlib
import subprocess
import sys

import memfit


def test_every_exported_name_exists_and_is_documented():
    assert len(set(memfit.__all__)) == len(memfit.__all__)
    for name in memfit.__all__:
        obj = getattr(memfit, name)
        assert obj.__doc__ and len(obj.__doc__.strip()) > 20, f"memfit.{name} has no docstring"


def test_version_has_one_source():
    text = open(memfit.__file__.replace("__init__.py", "../../pyproject.toml")).read()
    assert 'dynamic = ["version"]' in text and 'attr = "memfit.__version__"' in text
    assert "version = \"" not in text           # no literal version beside __version__


def test_import_is_cheap_and_has_no_side_effects():
    code = "import sys; import memfit; print('sklearn' in sys.modules, 'matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": ":".join(sys.path)})
    sklearn, mpl = out.stdout.split()
    assert sklearn == "False" and mpl == "False"      # optional dependencies load only when used


def test_submodules_are_documented():
    for mod in ("accumulation", "arrays", "budget", "chunking", "codecs", "compact", "distributed", "evaluation",
                "fields", "measure", "metrics", "progress", "readers", "cli", "cli.data", "cli.demo", "cli.options",
                "cli.plan", "cli.bench", "loading", "planner", "planner.footprint"):
        m = importlib.import_module(f"memfit.{mod}")
        assert m.__doc__ and len(m.__doc__) > 40, mod
