"""The run's world (fastgrpo/distributed.py `World`, fastgrpo/types.py `EngineMap`): engines tile the
policy ranks, each engine answers a contiguous, balanced share of whole prompts, and what engine
leaders gather reaches every rank in engine order."""

from __future__ import annotations

import pytest

from fastgrpo.local_world import run_world
from fastgrpo.topology import EngineMap


@pytest.mark.parametrize("policy_ranks, tensor", [(1, 1), (4, 1), (4, 2), (4, 4), (6, 2), (8, 8)])
def test_engine_shares_tile_the_prompts_and_ranks(policy_ranks, tensor):
    engines = EngineMap(policy_ranks, tensor)
    assert engines.leaders() == [r for r in range(policy_ranks) if engines.leads(r)]
    assert [engines.engine_of(r) for r in range(policy_ranks)] == [r // tensor for r in range(policy_ranks)]
    assert engines.engine_of(policy_ranks) is None and not engines.leads(policy_ranks)  # a draft rank
    for items in range(0, 21):
        shares = [range(*engines.bounds(items, e)) for e in range(engines.engines)]
        assert [i for s in shares for i in s] == list(range(items))  # contiguous, in order, all of them
        assert max(map(len, shares)) - min(map(len, shares)) <= 1  # balanced


def test_a_tensor_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(ValueError, match="engine.tensor=3 does not divide the 4 policy ranks"):
        EngineMap(4, 3)


def _exchange(rank, world):
    import datetime

    import torch.distributed as dist

    from fastgrpo.distributed import World
    from fastgrpo.types import Placement

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # no collective waits longer
    try:
        w = World(dist.get_rank(), dist.get_world_size(), Placement(), EngineMap(world, 2))
        start, mine = w.share(list(range(7)))
        answer = [f"engine {w.engine}: {x}" for x in mine] if w.leads_engine else None
        gathered = w.gather(answer)
        return dict(engine=w.engine, leads=w.leads_engine, start=start, mine=mine, gathered=gathered,
                    any=w.any(rank == 3), none=w.any(False), broadcast=w.broadcast(f"from {rank}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a multi-process world
def test_engine_leaders_share_and_gather_over_a_world_of_four(tmp_path):
    """Four policy ranks, engines of two: ranks 0 and 2 lead; both ranks of an engine see its share;
    every rank receives the leaders' answers in engine order (a non-leader's None is not among them)."""
    results = run_world(_exchange, 4, tmp_path)
    assert [r["engine"] for r in results] == [0, 0, 1, 1] and [r["leads"] for r in results] == [True, False, True, False]
    assert [(r["start"], r["mine"]) for r in results] == [(0, [0, 1, 2]), (0, [0, 1, 2]), (3, [3, 4, 5, 6]),
                                                          (3, [3, 4, 5, 6])]
    want = [[f"engine 0: {x}" for x in (0, 1, 2)], [f"engine 1: {x}" for x in (3, 4, 5, 6)]]
    assert all(r["gathered"] == want for r in results)
    assert all(r["any"] and not r["none"] and r["broadcast"] == "from 0" for r in results)



def _init_world_and_leave(rank, world, out):
    """A world made as `fastgrpo train` makes it (`init_world`: a policy rank and a draft rank, each
    its own default group, and the channel between them), a message sent, then left as a run leaves
    it; at exit the process records whether a group was still there."""
    import atexit

    import torch
    import torch.distributed as dist

    from fastgrpo import distributed

    # registered before init_world registers its handler, so it runs after it (last in, first out)
    atexit.register(lambda: (out / f"exit{rank}").write_text(
        f"initialized={dist.is_initialized()} channel={distributed._channel is not None}"))
    distributed.init_world(draft_ranks=1)
    t = torch.full((1,), 7.0) if rank == 0 else torch.zeros(1)
    dist.all_reduce(t)  # each rank's own default group
    if rank == 0:
        distributed._channel.send(t, 1, tag=3)
    else:
        distributed._channel.recv(t, 0, tag=3)
    return float(t.item())


@pytest.mark.slow  # a multi-process world
def test_a_run_world_destroys_its_groups_before_the_interpreter_exits(tmp_path):
    """Every process group `init_world` made is gone when the process exits: a gloo group left to the
    interpreter's finalization can abort the process, and a rank's abort ends a torchrun job."""
    assert run_world(_init_world_and_leave, 2, tmp_path / "world", tmp_path, timeout_s=120.0) == [7.0, 7.0]
    assert [(tmp_path / f"exit{r}").read_text() for r in range(2)] == ["initialized=False channel=False"] * 2


def _return_then_exit_badly(rank, world):
    import atexit
    import os
    import time

    if rank == 1:
        atexit.register(os._exit, 6)  # after its result is saved, as a teardown abort would
        return "done"
    time.sleep(60)  # still working when rank 1 fails
    return "late"


def test_a_rank_that_exits_badly_after_its_result_fails_the_world(tmp_path):
    """As under torchrun, a rank whose process exits badly fails the world even after it returned, and
    the error says so (not that the rank it ended gave no result)."""
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 exited with code 6 after its result \(ranks \[0\] were "
                                           r"ended then\)"):
        run_world(_return_then_exit_badly, 2, tmp_path, timeout_s=120.0)


def _where(rank, world):
    import os
    import sys

    return {"mark": os.environ.get("FASTGRPO_TEST_MARK"), "cwd": os.getcwd(), "rank": os.environ["RANK"],
            "preloaded": "megatron.core" in sys.modules and "fastgrpo.train" in sys.modules}


def test_a_rank_starts_in_the_callers_environment_and_directory_at_the_call(tmp_path, monkeypatch):
    """Ranks forked from the preloading server (started by this process's first world, with its environment then)
    still start as spawned ones would: with the environment and working directory of the call, a
    variable set since there and one removed since gone; and with the heavy modules already imported."""
    import torch

    monkeypatch.setenv("FASTGRPO_TEST_MARK", "at the first world")
    first = run_world(_where, 1, tmp_path / "first")
    assert first[0]["mark"] == "at the first world"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FASTGRPO_TEST_MARK", "at the second")
    assert [r["mark"] for r in run_world(_where, 2, tmp_path / "second")] == ["at the second"] * 2
    monkeypatch.delenv("FASTGRPO_TEST_MARK")
    third = run_world(_where, 2, tmp_path / "third")
    assert [(r["mark"], r["cwd"], r["rank"]) for r in third] == [(None, str(tmp_path), "0"), (None, str(tmp_path), "1")]
    if not torch.cuda.is_available():  # spawned there: nothing preloaded
        assert all(r["preloaded"] for r in first + third)


HELD = []  # a group held past `close_world`, as DeepSpeed's engine, ZeRO-3 parameters and module globals hold it


def _leave_collectives_unwaited_on_a_held_group(rank, world):
    """A world whose group outlives `destroy_process_group` (held here, as DeepSpeed holds its world
    group) and whose last collectives are still in gloo's worker threads when the rank returns."""
    import atexit

    import torch
    import torch.distributed as dist

    from fastgrpo.distributed import close_world

    dist.init_process_group("gloo", rank=rank, world_size=world)
    atexit.register(close_world)
    HELD.append(dist.group.WORLD)
    for _ in range(4):
        out = [torch.empty(1000) for _ in range(world)]
        dist.group.WORLD.allgather([out], [torch.full((1000,), float(rank))])  # not waited for
    return rank


@pytest.mark.slow  # multi-process worlds
def test_a_rank_ends_cleanly_while_a_held_group_still_has_work(tmp_path):
    """The rank's process ends through `end_process`, as the `fastgrpo` command ends it: with the
    interpreter's normal exit instead, the held group's workers release the collectives' tensors after
    finalization began and the process aborts (SIGABRT) in most of these worlds."""
    for attempt in range(3):
        assert run_world(_leave_collectives_unwaited_on_a_held_group, 2, tmp_path / str(attempt),
                         timeout_s=120.0) == [0, 1]


def _exit_status_and_handlers(code, marker):
    import atexit

    from fastgrpo.process_exit import end_process

    atexit.register(lambda: marker.write_text("ran"))
    end_process(code)


def _exit_with_an_idle_thread_pool(marker):
    from concurrent.futures import ThreadPoolExecutor

    from fastgrpo.process_exit import end_process

    pool = ThreadPoolExecutor(2)  # left open, as a library may leave one: its workers are not daemons
    marker.write_text(str(pool.submit(sum, [1, 2]).result()))
    end_process(5)


def test_end_process_stops_an_idle_thread_pool_as_the_interpreter_does(tmp_path):
    """Joining the pool's workers without first telling the pool to stop would wait forever."""
    import multiprocessing

    p = multiprocessing.get_context("spawn").Process(target=_exit_with_an_idle_thread_pool, args=(tmp_path / "ran",))
    p.start()
    p.join(120)
    hung = p.exitcode is None
    if hung:
        p.kill()
        p.join()
    assert not hung and p.exitcode == 5 and (tmp_path / "ran").read_text() == "3"


def test_end_process_runs_the_exit_handlers_and_keeps_the_status(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    for code in (0, 3):
        marker = tmp_path / f"handler{code}"
        p = ctx.Process(target=_exit_status_and_handlers, args=(code, marker))
        p.start()
        p.join(120)
        assert p.exitcode == code and marker.read_text() == "ran"
