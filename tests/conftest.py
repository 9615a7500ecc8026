"""Shared fixtures: models are loaded once per session and never mutated by tests."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.manual_seed(0)

# Under pytest-xdist (`make test` runs one worker per core, up to 4) each worker gets its share of
# the cores -- torch's threads here, OpenMP's in what it starts (notebook kernels, CLI processes) --
# instead of every worker spinning threads on every core.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    _SHARE = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_SHARE)
    torch.set_num_threads(_SHARE)


@pytest.fixture(autouse=True)
def seeded():
    """Every test draws the same random inputs whichever tests ran before it (a ``-k`` selection, a
    reordering): a tolerance that holds once holds on every run."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def cpu_unless_gpu_test(request, monkeypatch):
    """``device="auto"`` is CUDA on a GPU machine; the CPU tests' numbers and tokens are fp32 CPU
    ones, so there they resolve ``auto`` to the CPU. Tests marked ``gpu`` (and ``real_devices``,
    which check ``auto`` itself) see the machine as it is."""
    if request.node.get_closest_marker("gpu") or request.node.get_closest_marker("real_devices"):
        return
    import workbench.models.devices as devices

    monkeypatch.setattr(devices, "auto_device", lambda min_gpus=1: torch.device("cpu"))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2 with its GGUF weights dequantized to fp32: the model the HF-equivalence tests use."""
    from workbench.models import load_model

    return load_model("smollm2", gguf_weights="dequantize")


@pytest.fixture(scope="session")
def smollm2_q4():
    """SmolLM2 as shipped: Q4_1 linears, Q8_0 tied embedding/LM head, kept quantized."""
    from workbench.models import load_model

    return load_model("smollm2")


@pytest.fixture(scope="session")
def tiny_llama():
    from workbench.models import load_model

    return load_model("tiny:llama")


@pytest.fixture(scope="module", autouse=True)
def one_thread(request):
    """One torch thread for the tests of a module that sets ``ONE_THREAD = True``: the CI machine
    has 2 shared cores, and with the other one busy OpenMP's spin-waiting makes the small ops of
    decode steps 10-30x slower."""
    try:
        asked = getattr(request.module, "ONE_THREAD", False)
    except AttributeError:  # items without a Python module (notebooks under nbval)
        asked = False
    if not asked:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_llama_done(tiny_llama):
    """tiny:llama through the whole default pipeline (numerics off), one per test module."""
    from workbench import Workbench

    bench = Workbench(tiny_llama, numerics=False)
    bench.run()
    return bench


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be a CPU of another architecture and features: ``cpu("x86_64", features)`` (what
    the CPU-kernel variant choice reads, ``workbench.ops.cpu_kernels.isa``)."""
    from workbench.ops.cpu_kernels import isa

    def pretend(arch: str, features) -> None:
        monkeypatch.setattr(isa, "machine_arch", lambda: arch)
        monkeypatch.setattr(isa, "cpu_features", lambda: frozenset(features))

    return pretend
