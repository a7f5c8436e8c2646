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


@pytest.fixture(scope="module")
def tiny(request):
    """A tiny random model and its tokenizer, loaded fresh for each test module (tests may change it).

    tiny-llama, unless the module sets ``TINY_MODELS = [...]``: then every test that uses ``tiny`` runs once
    per name (module-scoped, so each model loads once; the fast tier only on the first, see below). ``TINY_DEVICE`` in the module puts it on a device.
    """
    from zoomkv.models import load_model

    return load_model(getattr(request, "param", "tiny-llama"), device=getattr(request.module, "TINY_DEVICE", None))


# The longest test files first (seconds of one process, measured with --junitxml): `make test` hands whole files to
# its processes in collection order (`--no-loadscope-reorder`), and a long file handed out last runs alone at the end.
LONGEST_FIRST = ("test_smollm2.py", "test_cuda_standin.py", "test_kernels.py", "test_compile_step.py",
                 "test_train_deepspeed.py", "test_graphs.py", "test_hardening3.py", "test_train.py",
                 "test_eval_harness.py", "test_eval_shards.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest keep their order)


def pytest_generate_tests(metafunc):
    names = getattr(metafunc.module, "TINY_MODELS", None)
    if names and "tiny" in metafunc.fixturenames:
        # The fast tier (`make check`) runs a module's matrix on its first model; the other layouts run in
        # `make test` (marked heavy), unless the module sets TINY_MODELS_FAST = "all" (the layout checks).
        every = getattr(metafunc.module, "TINY_MODELS_FAST", "first") == "all"
        params = [pytest.param(n, marks=() if every or i == 0 else pytest.mark.heavy) for i, n in enumerate(names)]
        metafunc.parametrize("tiny", params, indirect=True, scope="module", ids=names)
