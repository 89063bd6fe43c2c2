"""The flags a wrapped training script gains from core: accelerator, strategy, devices, nodes, precision."""
from dataclasses import dataclass, field

from core.fabric import ACCELERATORS
from core.precision import PRECISIONS
from core.strategies import STRATEGIES


@dataclass
class FabricFlags:
    accelerator: str = field(default="auto", metadata={"help": "cpu, cuda, or auto (cuda when available)",
                                                       "choices": ACCELERATORS})
    strategy: str = field(default="auto", metadata={"help": "how models are wrapped and synchronised",
                                                    "choices": STRATEGIES})
    devices: str = field(default="1", metadata={"help": "processes per node (GPUs or CPU processes), or auto"})
    num_nodes: int = field(default=1, metadata={"help": "machines (more than one needs torchrun or SLURM)"})
    precision: str = field(default="32-true", metadata={"help": "numeric precision", "choices": PRECISIONS})

    def fabric_options(self) -> dict:
        devices = int(self.devices) if self.devices.isdigit() else self.devices
        return {"accelerator": self.accelerator, "strategy": self.strategy, "devices": devices,
                "num_nodes": self.num_nodes, "precision": self.precision}
