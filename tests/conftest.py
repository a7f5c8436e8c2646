"""Shared test settings.

The tiny random models run many small tensor ops, which one thread does faster than two fighting over
this 2-core machine; the real-model tests (tests/test_smollm2.py) raise it again for their big matmuls.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread_for_tiny_ops():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
