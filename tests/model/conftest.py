"""Every test of the packed model starts with its (module-shared) model's pools free."""

import pytest


@pytest.fixture(autouse=True)
def _free_states():
    yield
    from tests.model.support import free_test_states  # imported late: after tests/conftest.py chose the interpreter

    free_test_states()
