"""One rank of a 2-process gloo job that exits right after its last collective (the case that aborted ranks in CI).

Usage: `python gloo_last_collective.py <rank> <port> {pause,none}`. It keeps a reference to the process group (as the
DDP/DeepSpeed wrappers do), ends with an `all_gather` of Python-owned tensors, destroys the group and returns. With
`pause` it registers `trl_agentic.gloo_exit`'s exit pause, as the trainer and the CLI do.
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# Loaded by path: importing the `trl_agentic` package (trainer, TRL, transformers) would take seconds per rank.
_spec = importlib.util.spec_from_file_location("gloo_exit", Path(__file__).parents[3] / "trl_agentic" / "gloo_exit.py")
gloo_exit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gloo_exit)

rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
if mode == "pause":
    assert gloo_exit.register_gloo_exit_pause()
keep_alive = dist.group.WORLD  # a wrapper still holding the group: its worker threads outlive destroy_process_group
for _ in range(3):
    gathered = [torch.zeros(4) for _ in range(2)]
    dist.all_gather(gathered, torch.full((4,), float(rank)))
assert [int(t[0]) for t in gathered] == [0, 1]
dist.destroy_process_group()
