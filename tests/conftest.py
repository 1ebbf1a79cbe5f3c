"""Tests marked `@pytest.mark.cuda` need a CUDA device and are skipped without one (`pytest -m cuda`)."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


try:        # the same examples on every run: a red CI then always means a regression, never bad luck
    from hypothesis import settings
    settings.register_profile("memfit", derandomize=True, deadline=None, print_blob=True)
    settings.load_profile("memfit")
except ImportError:  # pragma: no cover
    pass
