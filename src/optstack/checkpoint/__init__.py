"""optstack.checkpoint: name-keyed, versioned, reshardable optimizer checkpoints with atomic writes.

    save_checkpoint(root, optimizer, step=100, scheduler=sched, model=model, keep_last=3)
    load_checkpoint(root, optimizer, scheduler=sched, model=model)   # root/latest, any data-parallel size
    save_checkpoint(..., key=secret) / load_checkpoint(..., key=secret)   # signed: tampering is refused
    handle = save_checkpoint(root, optimizer, step=100, blocking=False)   # written while training steps

Each rank writes only what it owns. The layout is in ``format.py``, the guarantees in ``save.py`` and ``load.py``.
"""

from optstack.checkpoint.background import SaveHandle
from optstack.checkpoint.dcp import OptimizerState
from optstack.checkpoint.format import VERSION, migrate
from optstack.checkpoint.interop import export_torch_state_dict, import_torch_state_dict, write_group_map
from optstack.checkpoint.io import CheckpointError
from optstack.checkpoint.load import CheckpointInfo, load_checkpoint
from optstack.checkpoint.safe import SafeFileSystemReader
from optstack.checkpoint.save import save_checkpoint

__all__ = [
    "VERSION", "CheckpointError", "CheckpointInfo", "OptimizerState", "SafeFileSystemReader", "SaveHandle",
    "export_torch_state_dict", "import_torch_state_dict", "load_checkpoint", "migrate", "save_checkpoint",
    "write_group_map",
]
