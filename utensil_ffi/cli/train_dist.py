"""utensil-train on several GPUs: one process per GPU, each a rank of one data-parallel run.

``--nproc-per-node N`` starts N copies of the program through
:mod:`utensil_ffi.distributed.launch`; under ``torchrun`` (or ``mpirun`` with torchrun's
variables) each copy finds its rank in the environment. The run is the one-GPU run:
``--batch-size`` is the global batch, each step's batch is split over the ranks
(``np.array_split``: shares may differ by one image), the gradients are averaged with one
all-reduce after backward, and BatchNorm becomes SyncBatchNorm
(statistics of the global batch; ``--no-sync-bn`` keeps per-rank statistics, PyTorch's DDP
default). So a checkpoint resumes with any number of GPUs. Rank 0 alone prints, draws the
progress bar, writes the checkpoint (atomically) and the plot; the metrics are summed over the
ranks. A rank that fails stops the others (the launcher); one that hangs makes the others
fail within the group's timeout (``$UTENSIL_DIST_TIMEOUT``, default 600 s).
"""

import os

import numpy as np

__all__ = ["Dist", "launched_world_size", "strip_nproc_flag", "bind_local_gpu", "connect"]


class Dist:
    """This process's part of a data-parallel run: ``group`` (a ProcessGroup or a stand-in with
    all_reduce/broadcast/all_reduce_floats), ``rank``, ``world``, ``sync_bn``."""

    def __init__(self, group, rank, world, sync_bn=True):
        self.group, self.rank, self.world, self.sync_bn = group, rank, world, sync_bn

    @property
    def is_main(self):
        return self.rank == 0

    def share(self, idx):
        """This rank's part of one global batch of indices."""
        return np.array_split(idx, self.world)[self.rank]

    def grad_scale(self, mine, whole):
        """What this rank's mean-loss gradient is multiplied by so that the ranks' average is
        the gradient of the global batch's mean loss (shares may differ in size)."""
        return mine * self.world / whole

    def sum_floats(self, values):
        return self.group.all_reduce_floats(values, "sum")

    def wrap(self, net):
        """``net`` as every rank's one model: DDP, with SyncBatchNorm unless sync_bn is off."""
        from ..distributed import DistributedDataParallel
        from ..nn.sync_batchnorm import SyncBatchNorm

        if self.sync_bn:
            SyncBatchNorm.convert_sync_batchnorm(net, self.group)
        # synced statistics are equal on every rank already: no per-step buffer broadcast
        return DistributedDataParallel(net, self.group, broadcast_buffers=not self.sync_bn)

    def check_batches(self, n, batch_size):
        """Why some rank would get an empty share of a batch (None when none would). A last
        batch of one image is no batch: data.batches drops it (BatchNorm needs two values)."""
        last = n % batch_size
        if last == 1 and n > batch_size:
            last = 0
        for size, what in ((batch_size, "--batch-size"), (last, "the last batch of an epoch")):
            if 0 < size < self.world:
                return ("%s holds %d images, fewer than the %d processes: every process needs at "
                        "least one (choose a batch size that leaves 0 or at least %d images in "
                        "the last batch of %d)" % (what, size, self.world, self.world, n))
        return None

    def close(self, ok):
        if ok:
            self.group.barrier()
            self.group.close()
        else:
            self.group.abort()


def launched_world_size(environ=None):
    """WORLD_SIZE when a launcher (torchrun, utensil_ffi.distributed.launch) started this
    process, else 0."""
    environ = os.environ if environ is None else environ
    text = environ.get("WORLD_SIZE", "").strip()
    return int(text) if text.isdigit() and "RANK" in environ else 0


_NPROC = "--nproc-per-node"


def _is_nproc(name):
    """Whether an option name argparse accepted is a spelling of --nproc-per-node: the whole
    name or an abbreviation (argparse takes any unambiguous prefix: '--nproc 2')."""
    return len(name) >= 3 and _NPROC.startswith(name)


def strip_nproc_flag(argv):
    """argv without --nproc-per-node (in any spelling argparse accepts) and its value, for the
    copies the launcher starts: a copy that got it would refuse to start a launcher again."""
    out, skip, options = [], False, True
    for a in argv:
        if skip:
            skip = False
        elif not options:
            out.append(a)
        elif a == "--":  # what follows is positional
            options = False
            out.append(a)
        elif _is_nproc(a):
            skip = True
        elif not (a.startswith("--") and "=" in a and _is_nproc(a.split("=", 1)[0])):
            out.append(a)
    return out


def bind_local_gpu(local_rank, environ=None):
    """Make this process see only its own GPU when the launcher left several visible (torchrun
    does): must run before the first CUDA call in the process."""
    environ = os.environ if environ is None else environ
    visible = [v for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        environ["CUDA_VISIBLE_DEVICES"] = str(local_rank)
    elif len(visible) > 1:
        environ["CUDA_VISIBLE_DEVICES"] = visible[local_rank % len(visible)]


def connect(sync_bn=True):
    """Join the run the environment describes (NCCL over the bootstrap at MASTER_ADDR)."""
    from ..distributed import ProcessGroup, env_from_environ

    env = env_from_environ()
    bind_local_gpu(env.local_rank)
    return Dist(ProcessGroup(env), env.rank, env.world_size, sync_bn)
