"""A stand-in for utensil_ffi.distributed.ProcessGroup over threads of one process, the
collectives done in numpy float64: tests of what data-parallel code does with a group, on a
machine without GPUs (NCCL itself is checked by tests/dist_child.py on two GPUs)."""

import threading

import numpy as np


class ThreadGroup:
    """``world`` ranks as threads; ``member(rank)`` is that rank's group (all_reduce and
    broadcast in place on Tensors, as ProcessGroup's)."""

    def __init__(self, world):
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots = [None] * world

    def member(self, rank):
        group = self

        class Member:
            def all_reduce(self, t, op="avg"):
                group.slots[rank] = t.numpy().astype(np.float64)
                group.barrier.wait()
                total = np.sum(group.slots, axis=0)
                group.barrier.wait()
                t.copy_from((total / group.world if op == "avg" else total).astype(np.float32))
                return t

            def all_reduce_floats(self, values, op="sum"):
                group.slots[rank] = np.asarray(values, np.float64).ravel()
                group.barrier.wait()
                total = np.sum(group.slots, axis=0)
                group.barrier.wait()
                return total / group.world if op == "avg" else total

            def broadcast(self, t, src=0):
                if rank == src:
                    group.slots[src] = t.numpy().copy()
                group.barrier.wait()
                value = group.slots[src].copy()
                group.barrier.wait()
                t.copy_from(value)
                return t

        return Member()


def run_ranks(world, rank_main, timeout=60):
    """rank_main(rank, group_member) on ``world`` threads; {rank: its result}. A rank's
    exception is raised here (the others are released from their barriers)."""
    group = ThreadGroup(world)
    results, errors = {}, []

    def one(r):
        try:
            results[r] = rank_main(r, group.member(r))
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results
