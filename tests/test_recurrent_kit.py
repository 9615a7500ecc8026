"""The cached-state op kit (``workbench/ops/recurrent.py``): a new recurrent family from its math and
one description -- the walkthrough of ``workbench/ops/README.md`` ("Adding a recurrent family"),
run -- and the kit's own checks (metadata, state shape, descriptions it refuses).

The example family is an exponential moving average per channel, the smallest recurrence with a
state: ``h_t = a * h_{t-1} + (1 - a) * x_t``, ``a = sigmoid(decay)``, output ``h_t``.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from workbench.ops.recurrent import RecurrentMath, RecurrentOp, RecurrentState, define_recurrent_op, read_step
from workbench.ops.state import stateful_op_for


# ------------------------------------------------------------- the walkthrough's family, as written there
def _check(i, options):
    x, decay = i["x"], i["decay"]
    if x.dim() != 3 or tuple(decay.shape) != (x.shape[-1],):
        raise ValueError(f"torch_kit_ema expects x [b, s, c] and decay [c]; got {tuple(x.shape)}, {tuple(decay.shape)}")


def _run(i, init: Optional[torch.Tensor], options):
    """Whole sequences [b, s, c] from init [b, c] (None: zeros), a loop (it is an example)."""
    a = torch.sigmoid(i["decay"].float())
    h = torch.zeros_like(i["x"][:, 0], dtype=torch.float32) if init is None else init.float()
    ys = []
    for t in range(i["x"].shape[1]):
        h = a * h + (1 - a) * i["x"][:, t].float() * options["gain"]
        ys.append(h)
    return torch.stack(ys, dim=1), h


def _step(i, held, fresh, options):
    """One token per row: x [n, c] from held [n, c]."""
    a = torch.sigmoid(i["decay"].float())
    h = a * held.float() + (1 - a) * i["x"].float() * options["gain"]
    return h, h


EMA = define_recurrent_op(
    RecurrentOp(
        name="kit_ema",
        inputs="Tensor x, Tensor decay",
        options="float gain=1.0",
        state=RecurrentState(
            "ema_state",
            shape=lambda args: (int(args["x"].shape[-1]),),
            dtype=torch.float32,
            layout="c",
            description="moving average per channel, [c], fp32",
        ),
        token_args=("x",),
        insert_key="insert_cached_ssm_attention",
        math=RecurrentMath(check=_check, run=_run, step=_step),
    )
)


def _meta(lens, pos, slots, num_prefill):
    return (torch.tensor(lens, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32),
            torch.tensor(slots, dtype=torch.int32), num_prefill)


def test_the_description_defines_three_ops_and_the_state_entry():
    wb = torch.ops.workbench
    assert EMA.uncached is wb.torch_kit_ema and EMA.torch_cached is wb.torch_cached_kit_ema
    assert EMA.triton_cached is None  # no triton_decode: no Triton backend op
    entry = stateful_op_for(wb.torch_kit_ema.default)
    assert entry is EMA.stateful and dict(entry.cached) == {"torch": "workbench::torch_cached_kit_ema"}
    assert entry.insert_key == "insert_cached_ssm_attention" and entry.token_args == ("x",)
    assert entry.description == "moving average per channel, [c], fp32"  # the state's, for tables and renders
    schema = str(wb.torch_cached_kit_ema.default._schema)
    assert "Tensor(a!) ema_state, *, float gain=1." in schema and "SymInt num_prefill" in schema


def test_cached_step_continues_what_the_uncached_op_computes():
    """Sequence 0 is new (4 tokens), sequence 1 continues after 3 tokens (a chunked prefill of 2),
    sequences 2 and 3 decode one token each; every output and state row equals the uncached op run
    over each sequence's whole history."""
    torch.manual_seed(0)
    c = 5
    decay = torch.randn(c)
    hist = {i: torch.randn(1, n, c) for i, n in enumerate((4, 5, 7, 2))}  # whole history per sequence
    new = {0: 4, 1: 2, 2: 1, 3: 1}  # new tokens this step
    state = torch.full((6, c), float("nan"))  # a fresh sequence ignores whatever its slot holds
    slots = [4, 1, 0, 2]
    for i in (1, 2, 3):  # the continuing sequences' state after their earlier tokens
        state[slots[i]] = EMA.uncached(hist[i][:, : -new[i]], decay, gain=0.5)[0, -1]
    x = torch.cat([hist[i][:, -new[i]:] for i in range(4)], dim=1)  # [1, 8, c]
    pos = [0] + [hist[i].shape[1] - new[i] for i in (1, 2, 3)]
    out = EMA.torch_cached(x, decay, *_meta(list(new.values()), pos, slots, 2), state, gain=0.5)
    start = 0
    for i in range(4):
        full = EMA.uncached(hist[i], decay, gain=0.5)
        torch.testing.assert_close(out[:, start : start + new[i]], full[:, -new[i]:])
        torch.testing.assert_close(state[slots[i]], full[0, -1])
        start += new[i]
    assert torch.isnan(state[[3, 5]]).all()  # rows no sequence owns are untouched


def test_fake_and_defaults_come_from_the_schema():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = EMA.uncached(torch.empty(2, 3, 4), torch.empty(4))
    assert out.shape == (2, 3, 4)
    x, decay = torch.randn(1, 3, 4), torch.randn(4)
    torch.testing.assert_close(EMA.uncached(x, decay), EMA.uncached(x, decay, gain=1.0))  # default filled


def test_kit_errors_name_the_problem():
    x, decay = torch.randn(1, 3, 4), torch.randn(4)
    ok_state = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"ema_state must be \[num_slots, c\]"):
        EMA.torch_cached(x, decay, *_meta([3], [0], [0], 1), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="flattened tokens x"):
        EMA.torch_cached(torch.randn(2, 3, 4), decay, *_meta([3], [0], [0], 1), ok_state)
    with pytest.raises(ValueError, match="seq_lens sum to 2 tokens but x has 3"):
        EMA.torch_cached(x, decay, *_meta([2], [0], [0], 1), ok_state)
    with pytest.raises(ValueError, match="torch_kit_ema expects x"):  # the family's own check, first
        EMA.uncached(x, torch.randn(5))


def test_a_description_naming_an_unknown_token_arg_is_refused():
    with pytest.raises(ValueError, match=r"token_args \['y'\] are not among its inputs"):
        RecurrentOp(name="kit_bad", inputs="Tensor x", options="", state=EMA.stateful.states[0], token_args=("y",),
                    insert_key="insert_cached_ssm_attention", math=RecurrentMath(check=_check, run=_run, step=_step))


def test_decode_only_step_reads_no_lengths():
    """A capturable step (``host=False``) checks sizes only: no host list, decode rows from token 0."""
    meta = read_step(3, *_meta([1, 1, 1], [2, 0, 5], [0, 1, 2], 0), "x", host=False)
    assert meta.lens is None and meta.num_decode == 3 and meta.first_decode_token == 0
    with pytest.raises(ValueError, match="one token per sequence"):
        read_step(4, *_meta([1, 1, 1], [2, 0, 5], [0, 1, 2], 0), "x", host=False)


def _definitions(source: str) -> dict:
    """Top-level functions and assignments by name, without docstrings and annotations."""
    import ast

    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
                node.body = node.body[1:]
            node.returns = None
            for a in node.args.args:
                a.annotation = None
            out[node.name] = ast.dump(node)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = ast.dump(node)
    return out


def test_the_readme_walkthrough_is_this_family():
    """The code of ``ops/README.md``'s walkthrough is the family this module defines and runs."""
    import pathlib
    import re

    import workbench.ops

    readme = (pathlib.Path(workbench.ops.__file__).parent / "README.md").read_text()
    section = readme.split("## Adding a recurrent family", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = _definitions("\n".join(line[3:] for line in block.splitlines()))
    here = _definitions(pathlib.Path(__file__).read_text())
    assert set(shown) == {"_check", "_run", "_step", "EMA"}, sorted(shown)
    assert {name: here.get(name) for name in shown} == shown
