"""What a `workbench run` process loads before it needs it.

Importing the workbench must not import Dynamo (with Inductor and Triton: ~1 s, ~140 MB); a CLI
program run on a machine where no Triton kernel can run keeps triton unloaded (~72 MB),
and still answers. Each case runs in a fresh interpreter: what is imported is per process.
"""

import os
import subprocess
import sys

import pytest

from workbench.cli import main

# run the CLI as a program (argv from the command line), then say whether triton got loaded
_PROGRAM = """
import runpy, sys
sys.argv = ["workbench", "run", "--model", "tiny:llama", "--no-numerics", "--max-new-tokens", "2"]
try:
    runpy.run_module("workbench.cli", run_name="__main__")
except SystemExit as e:
    print("exit", e.code)
print("triton loaded:", sys.modules.get("triton") is not None)
"""


def _python(code: str, **env_changes) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_changes)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_importing_the_workbench_does_not_import_dynamo():
    out = _python(
        "import sys, workbench, workbench.cli\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'triton') if m in sys.modules))"
    )
    assert out.strip() == "[]"


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="with a CUDA device Triton kernels can run: triton stays loadable"
)
def test_a_cpu_program_run_leaves_triton_unloaded_and_answers():
    out = _python(_PROGRAM)
    assert "exit 0" in out and "generate: 2 tokens" in out
    assert "triton loaded: False" in out


def test_with_the_interpreter_on_triton_loads_as_usual():
    out = _python(_PROGRAM, TRITON_INTERPRET="1")
    assert "exit 0" in out and "triton loaded: True" in out


def test_main_called_with_arguments_leaves_the_process_alone(capsys, monkeypatch):
    # a test, a notebook or a script calling main([...]) owns its process: triton stays importable
    # the conditions under which a program run would keep triton out: not loaded, no CUDA, no interpreter
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["transforms"]) == 0
    assert "triton" not in sys.modules
