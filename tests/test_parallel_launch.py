"""Sharded runs' process side (``workbench.parallel``): 2 CPU ranks on gloo, localhost only.

What a user relies on: ``Workbench(..., world_size=2)`` gives the tokens one process gives, the
snapshots and table carry every rank's memory, renders come from any rank; a rank that raises or is
killed ends the command in bounded time with that rank named, leaves no process behind and keeps the
snapshots already received; typos fail before any process starts; ``workbench run --world-size 2``
prints once.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from workbench import ConfigError, Workbench
from workbench.parallel import RankError, ShardedWorkbench
from workbench.runtime.generate import DEFAULT_PROMPT
from workbench.runtime.generate import text_prompt_ids as prompt_token_ids

PROMPTS = [[1, 2, 3, 4, 5], [17, 3, 99], [400, 12, 7, 7, 250, 31, 8]]
BOUND_S = 60.0  # a failure must end a command within this, however the ranks are stuck
TESTS_DIR = str(Path(__file__).parent)


def _gone(pids, within_s: float = 10.0) -> bool:
    """True once none of ``pids`` is a live process (reaped, or a zombie waiting to be)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def sharded():
    """tiny:llama on 2 ranks, run to the end (the sharding transforms shard it when they are in the
    default pipeline; otherwise every rank runs the whole model)."""
    wb = Workbench("tiny:llama", world_size=2, numerics=False)
    t0 = time.perf_counter()
    wb.run()
    wb.run_s = time.perf_counter() - t0
    yield wb
    pids = wb.pids
    wb.close()
    assert _gone(pids), "close() left rank processes running"


def test_two_ranks_generate_the_tokens_of_one_process(sharded, tiny_llama_done):
    assert isinstance(sharded, ShardedWorkbench) and sharded.done
    assert len({f["pid"] for f in sharded.rank_facts}) == 2 and all(f["backend"] == "gloo" for f in sharded.rank_facts)
    expected = tiny_llama_done.generate(PROMPTS, max_new_tokens=16, temperature=0.0)
    got = sharded.generate(PROMPTS, max_new_tokens=16, temperature=0.0)
    assert got.token_ids == expected.token_ids
    assert all(len(t) == 16 for t in got.token_ids)
    assert got.stats.generated_tokens == 48


def test_snapshots_and_table_have_one_row_per_transform_with_per_rank_memory(sharded):
    snaps, table = sharded.snapshots, sharded.table()
    assert [s.key for s in snaps] == sharded.keys == list(table["transform"])
    assert all(s.world_size == 2 and [r.index for r in s.ranks] == [s.index] * 2 for s in snaps)
    for r in (0, 1):
        assert {f"mem_MiB_r{r}", f"d_mem_MiB_r{r}", f"nodes_r{r}"} <= set(table.columns)
    # load_weights gives each rank real tensors: its memory moves on both ranks, from 0 before it.
    lw = sharded.snapshot("load_weights")
    rows = lw.per_rank()
    assert [row["rank"] for row in rows] == [0, 1]
    assert all(row["mem_before_MiB"] == 0 and row["mem_after_MiB"] > 0 for row in rows)
    assert table.loc[sharded.index("load_weights"), "mem_MiB_r1"] == rows[1]["mem_after_MiB"]
    # The export step's node diff: every node is new there, on each rank.
    export = sharded.snapshots[0].per_rank()
    assert all(row["added_nodes"] == row["nodes"] > 0 for row in export)
    if "sharding_transform_executor" in sharded.keys and sharded.snapshot("sharding_transform_executor").info.num_matches:
        assert sharded.plan(), "the graph was sharded, so rank 0's plan has rows"


def test_render_and_memory_come_from_the_ranks(sharded):
    src = sharded.render("load_weights", rank=1)
    assert type(src).__name__ == "Source" and src.source.startswith("digraph")
    assert "load_weights" in src.source  # the snapshot's title
    mem = sharded.memory()
    assert list(mem["rank"]) == [0, 1] and list(mem["pid"]) == sharded.pids
    assert (mem["graph_MiB"] > 0).all() and (mem["cache_MiB"] > 0).all() and (mem["peak_rss_MiB"] > 0).all()
    with pytest.raises(KeyError, match="not in this pipeline"):
        sharded.render("no_such_transform")


def test_errors_raised_on_every_rank_keep_the_ranks_and_rewind_reruns_in_step(sharded):
    pids = sharded.pids
    with pytest.raises(ConfigError, match="enabledd"):  # raised by every rank: the one-process error type
        sharded.configure("fuse_rope", enabledd=False)
    with pytest.raises(KeyError, match="not in this pipeline"):  # checked in the parent, nothing sent
        sharded.rewind("no_such_transform")
    assert sharded.pids == pids and not sharded.closed and sharded.done
    last = sharded.keys[-2]
    before = sharded.snapshot(last)
    sharded.rewind(last)
    assert sharded.position == len(sharded.keys) - 2 and sharded.status(last) == "pending"
    again = sharded.step()
    assert again.key == last and again is not before and again.num_nodes == before.num_nodes
    sharded.run()
    assert sharded.done and [s.key for s in sharded.snapshots] == sharded.keys


def test_a_rank_raising_in_a_transform_brings_all_down_with_its_error():
    extra = {"transforms": {"raise_on_rank": {"stage": "post_load_fusion", "rank": 1}}}
    # numerics on: rank 0's probe after the failed step waits in an all-reduce for rank 1, which never comes.
    wb = Workbench("tiny:llama", world_size=2, numerics=True, worker_imports=["sharding_faults"], yaml_extra=[extra])
    pids, failing = wb.pids, wb.index("raise_on_rank")
    t0 = time.perf_counter()
    with pytest.raises(RankError) as err:
        wb.run()
    elapsed = time.perf_counter() - t0
    assert elapsed < BOUND_S
    assert err.value.rank == 1 and "rank 1 failed in run()" in str(err.value)
    assert "injected failure on rank 1" in str(err.value) and "RuntimeError" in str(err.value)
    assert "sharding_faults.py" in err.value.traceback  # the rank's own traceback travels
    assert _gone(pids), "a rank outlived the failure"
    # Everything both ranks finished before the failure is still readable.
    assert [s.key for s in wb.snapshots] == wb.keys[:failing]
    assert len(wb.table()) == failing
    with pytest.raises(RuntimeError, match="closed after rank 1 failed"):
        wb.step()


def test_a_killed_rank_is_reported_by_rank_and_exit_code():
    wb = Workbench("tiny:llama", world_size=2, numerics=False)
    pids = wb.pids
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(RankError) as err:
        wb.run()
    assert time.perf_counter() - t0 < BOUND_S
    assert err.value.rank == 1 and err.value.exitcode == -signal.SIGKILL
    assert "rank 1 died" in str(err.value) and "SIGKILL" in str(err.value)
    assert _gone(pids)
    with pytest.raises(RuntimeError, match="closed after rank 1 died"):
        wb.generate([[1, 2]], max_new_tokens=2)


def test_dropping_the_workbench_stops_its_ranks():
    wb = Workbench("tiny:llama", world_size=2, numerics=False)
    pids = wb.pids
    del wb
    gc.collect()
    assert _gone(pids)


@pytest.mark.parametrize("options, error, match", [
    (dict(overrides={"export_to_gm.strct": True}), ConfigError, "did you mean 'strict'"),
    (dict(yaml_extra=[{"transforms": {"no_such_transform": {"stage": "sharding"}}}]), ConfigError, "no_such_transform"),
    (dict(numerix=False), TypeError, "unknown option"),
    (dict(worker_imports=["no_such_module_xyz"]), ImportError, "no_such_module_xyz"),
    (dict(dist=None), ValueError, "launcher"),
    (dict(start_method="fork"), ValueError, "refused"),
])
def test_option_typos_fail_before_any_process_starts(options, error, match):
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}  # the fork server's ranks are grandchildren
    before_mp = set(multiprocessing.active_children())
    t0 = time.perf_counter()
    with pytest.raises(error, match=match):
        Workbench("tiny:llama", world_size=2, **options)
    assert time.perf_counter() - t0 < 2.0
    assert {p.pid for p in me.children(recursive=True)} == before
    assert set(multiprocessing.active_children()) == before_mp


def test_cli_world_size_2_prints_table_and_text_once(tiny_llama_done, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(TESTS_DIR).parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "workbench.cli", "run", "--model", "tiny:llama", "--world-size", "2",
           "--no-numerics", "--max-new-tokens", "8", "--dist-timeout", "120"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    header = [line for line in out.splitlines() if line.startswith("#") and "transform" in line]
    assert len(header) == 1
    assert len([line for line in out.splitlines() if line.split()[1:3] == ["export", "export_to_gm"]]) == 1
    assert out.count("\npipeline: ") == 1 and out.count("\ntokens: ") == 1 and out.count("\ngenerate: ") == 1
    assert "world size 2" in out
    assert out.count("sharding plan (2 ranks") == 1  # printed once, by rank 0
    assert "mha        sharded" in out and "r1: q heads 2-3, kv heads 1" in out
    ids = prompt_token_ids(DEFAULT_PROMPT, tiny_llama_done.ctx.vocab_size)
    expected = tiny_llama_done.generate([ids], max_new_tokens=8).token_ids[0]
    assert f"\ntokens: {expected}\n" in out
