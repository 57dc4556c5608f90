"""optstack.checkpoint: name-keyed, versioned, reshardable optimizer checkpoints with atomic writes.

    save_checkpoint(root, optimizer, step=100, scheduler=sched, model=model, keep_last=3)
    load_checkpoint(root, optimizer, scheduler=sched, model=model)   # root/latest, any data-parallel size

A checkpoint holds the fp32 masters, every algorithm's state, the loss scaler, the scheduler and (when
asked) the model's tensors, keyed by parameter name; each rank writes only what it owns, through
torch.distributed.checkpoint. See ``format.py`` for the layout and ``load.py`` for the guarantees.
"""

from optstack.checkpoint.format import VERSION, migrate
from optstack.checkpoint.interop import export_torch_state_dict, import_torch_state_dict, write_group_map
from optstack.checkpoint.load import CheckpointInfo, load_checkpoint
from optstack.checkpoint.save import save_checkpoint

__all__ = [
    "VERSION", "CheckpointInfo", "export_torch_state_dict", "import_torch_state_dict", "load_checkpoint",
    "migrate", "save_checkpoint", "write_group_map",
]
