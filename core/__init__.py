"""core: one `setup()` that runs plain PyTorch models and optimizers on one device, DDP, FSDP or DeepSpeed."""
from core.checkpoint import CheckpointError
from core.fabric import Fabric
from core.seed import seed_everything

__all__ = ["CheckpointError", "Fabric", "seed_everything"]
