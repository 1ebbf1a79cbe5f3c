"""memfit.readers as one import path: every reader of its modules is exported and documented.

Run: python -m pytest -q tests/readers/test_package.py
"""

from __future__ import annotations

from memfit import readers


def test_public_names_documented():
    for name in readers.__all__:
        doc = getattr(readers, name).__doc__
        assert doc and "Example:" in doc, name


def test_every_reader_of_a_submodule_is_exported_from_the_package():
    import importlib
    import pkgutil
    names = []
    for info in pkgutil.iter_modules(readers.__path__):
        module = importlib.import_module(f"memfit.readers.{info.name}")
        names += [(info.name, n) for n in module.__all__]
        assert all(getattr(readers, n) is getattr(module, n) for n in module.__all__), info.name
    assert sorted(n for _, n in names) == sorted(readers.__all__), names
