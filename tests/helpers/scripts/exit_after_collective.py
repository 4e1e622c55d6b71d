"""One rank of a 2-process gloo job that ends right after its last collectives, the way a training
script ends after ``trainer.fit`` or a full-table ``state_dict``. The groups stay referenced (as
DDP and the mesh hold them), so destroying them does not join gloo's threads. Without the exit
hook of ``lightning_twod.distributed.exit_hook`` such a process often aborts during interpreter finalization.

Usage: exit_after_collective.py RANK STORE_FILE
"""

import atexit
import sys

import torch
import torch.distributed as dist

from lightning_twod.distributed import destroy_process_groups_at_exit

rank, store = int(sys.argv[1]), sys.argv[2]
atexit.register(lambda: print("initialized after the hook:", dist.is_initialized()))  # runs after it
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
destroy_process_groups_at_exit()
destroy_process_groups_at_exit()  # a second registration is a no-op
held = [dist.group.WORLD, dist.new_group([0, 1])]
for _ in range(20):
    for group in held:
        ones = torch.ones(1000)
        dist.all_reduce(ones, group=group)
assert ones[0].item() == 2.0
