"""Every test of the packed model starts with its (module-shared) model's pools free."""

import pytest

from tests.model.support import free_test_states


@pytest.fixture(autouse=True)
def _free_states():
    yield
    free_test_states()
