"""The parity cases' model files, shared by every module of the library's tests."""

import pytest

from test_parity import ModelFiles


@pytest.fixture(scope="session")
def files(tmp_path_factory) -> ModelFiles:
    """Each parity case's model, written once for the whole run, and its oracle."""
    return ModelFiles(tmp_path_factory.mktemp("parity"))
