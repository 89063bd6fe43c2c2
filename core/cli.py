"""The flags a wrapped training script gains from core: accelerator, strategy, devices, nodes, precision."""
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core import checkpoint, launcher
from core.errors import CoreValueError
from core.precision import PRECISIONS
from core.strategies import NEEDS, STRATEGIES, check_installed, refusal, strategy_class
from core.validation import ACCELERATORS, check_devices, device_kind, resolve_arguments


@dataclass
class FabricFlags:
    accelerator: str = field(default="auto", metadata={"help": "cpu, cuda (or its alias gpu), or auto: cuda when "
                                                               "torch sees a GPU, else cpu",
                                                       "choices": ACCELERATORS})
    strategy: str = field(default="auto", metadata={
        "help": "how models are wrapped and synchronised; auto: ddp for several processes, else single. "
                "deepspeed* needs the deepspeed extra", "choices": ("auto", *STRATEGIES)})
    devices: str = field(default="1", metadata={
        "help": "processes on this machine (one per GPU, or CPU processes sharing the cores), or auto: one "
                "per visible GPU with cuda, 1 on cpu, the number started by torchrun or SLURM under them"})
    num_nodes: int = field(default=1, metadata={"help": "machines (more than one needs torchrun or SLURM)"})
    precision: str = field(default="32-true", metadata={"help": "numeric precision", "choices": tuple(PRECISIONS)})
    collective_timeout: float = field(default=1800, metadata={
        "help": "seconds a process waits in a collective for the others (for rank 0's evaluation, say) before it "
                "stops with an error naming this flag"})
    save_in_background: bool = field(default=False, metadata={
        "help": "write the periodic checkpoints in a background thread: training goes on once the state is copied "
                "(as much memory again as the model and optimizer state); the final save waits. Not with deepspeed"})

    def check(self):
        parent = getattr(super(), "check", None)  # the workload's Config, merged after this class
        if parent is not None:
            parent()
        if self.accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            build = f"torch {torch.__version__}, {build}"
            raise CoreValueError(f"--accelerator {self.accelerator}, but {build} sees no CUDA device; "
                                 f"use --accelerator cpu or auto")
        try:
            check_installed(self.strategy, device_kind(self.accelerator))
        except ImportError as error:
            raise CoreValueError(str(error)) from None
        try:  # here, not at Fabric(): before the note below, so that a refusal is one line
            check_devices(self.devices, device_kind(self.accelerator), launcher.cluster_environment())
        except ValueError as error:
            raise CoreValueError(f"--devices {self.devices}: {error}") from None
        if self.num_nodes < 1:
            raise CoreValueError(f"--num-nodes must be >= 1, got {self.num_nodes}")
        if self.num_nodes > 1 and launcher.cluster_environment() is None:  # launcher.start's rule, before it starts
            raise CoreValueError(
                f"--num-nodes {self.num_nodes} needs a launcher on every machine: run torchrun --nnodes "
                f"{self.num_nodes} --nproc-per-node N --node-rank R --master-addr HOST -m ... on each "
                f"(or srun under SLURM)")
        if self.strategy != "auto":  # auto is single or ddp, which give every need
            reason = refusal(self.strategy, self.precision, self.needs())
            if reason:
                needed = "; ".join(NEEDS[need] for need in sorted(self.needs()))
                raise CoreValueError(
                    f"--strategy {self.strategy} cannot run this workload, which needs {needed}: {reason}")
        if self.save_in_background and self.strategy.startswith("deepspeed"):
            raise CoreValueError(f"--save-in-background: --strategy {self.strategy} writes its engines' own files "
                                 f"with their own collectives, which cannot run beside training; drop the flag")
        if self.collective_timeout <= 0:
            raise CoreValueError(f"--collective-timeout must be > 0 seconds, got {self.collective_timeout:g}")
        if self.precision in ("16-mixed", "16") and device_kind(self.accelerator) == "cpu" and \
                self.strategy != "fsdp" and int(os.environ.get("RANK", "0")) == 0:  # fsdp refuses it with one line
            print("[core] --precision 16-mixed on the CPU: float16 autocast with a loss scaler, about 15x slower "
                  "than 32-true here (the CPU's kernels are float32 and bfloat16); --precision bf16-mixed is the "
                  "CPU's mixed precision.", file=sys.stderr, flush=True)

    def needs(self) -> set[str]:
        """What the workload needs of every strategy (core.strategies.NEEDS); its Config says, where it needs any."""
        parent = getattr(super(), "needs", None)
        return set(parent()) if parent is not None else set()

    @staticmethod
    def recover_checkpoint(path) -> None:
        """Before a resume looks for `path`: put back a checkpoint directory whose replacement was interrupted."""
        checkpoint.recover(Path(path))

    @staticmethod
    def verify_checkpoint(path) -> list[str]:
        """Before a resume from a run directory picks a checkpoint: what does not match its saved checksums."""
        return checkpoint.integrity.problems(Path(path))[0]

    def on_failure(self) -> None:
        """Called by the CLI before it exits with an error: this rank's exit must not wait for the others."""
        launcher.mark_failed()

    def fabric_options(self) -> dict:
        devices = int(self.devices) if self.devices.isdigit() else self.devices
        options = {"accelerator": self.accelerator, "strategy": self.strategy, "devices": devices,
                   "num_nodes": self.num_nodes, "precision": self.precision}
        strategy = resolve_arguments(*list(options.values())[:4])[1]  # "auto" as Fabric resolves it
        if strategy_class(strategy)[0].distributed:  # one process has no collective to wait in
            options["timeout"] = self.collective_timeout
        if self.needs():
            options["needs"] = self.needs()
        return options
