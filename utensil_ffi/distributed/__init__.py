"""Data-parallel training over several processes (one per GPU), torch.distributed's floor.

    from utensil_ffi import distributed as D
    env = D.env_from_environ()                       # RANK, WORLD_SIZE, ... (torchrun's names)
    group = D.ProcessGroup(env)                      # NCCL, loaded at run time
    model = D.DistributedDataParallel(model, group)

    python -m utensil_ffi.distributed.launch --nproc-per-node N script.py [args...]

    data_parallel.py  who is who (env_from_environ, env_from_mpi), meeting up (FileRendezvous),
                      the NCCL ProcessGroup, GradientBuffer, DistributedDataParallel,
                      DistributedSampler: their names are this package's own
    launch.py         the launcher: N processes with torchrun's environment (not imported here)
"""

# every name the module utensil_ffi.distributed had before it became this package (WHEEL_NCCL and
# DistributedError too)
from .._errors import DistributedError
from .data_parallel import (
    WHEEL_NCCL,
    DistEnv,
    DistributedDataParallel,
    DistributedSampler,
    FileRendezvous,
    GradientBuffer,
    ProcessGroup,
    env_from_environ,
    env_from_mpi,
    nccl_info,
)

__all__ = ["DistEnv", "env_from_environ", "env_from_mpi", "FileRendezvous", "ProcessGroup",
           "DistributedDataParallel", "GradientBuffer", "DistributedSampler", "nccl_info",
           "DistributedError"]
