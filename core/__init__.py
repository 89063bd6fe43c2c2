"""core: one `setup()` that runs plain PyTorch models and optimizers on one device, DDP, FSDP or DeepSpeed."""
from core.checkpoint import CheckpointError
from core.errors import CoreError, CoreRuntimeError, CoreTypeError, CoreValueError
from core.fabric import Fabric
from core.seed import seed_everything

__all__ = ["CheckpointError", "CoreError", "CoreRuntimeError", "CoreTypeError", "CoreValueError", "Fabric",
           "seed_everything"]
