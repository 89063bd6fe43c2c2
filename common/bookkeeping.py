"""What every training loop does after its optimizer steps, the same in the plain and the wrapped script."""
import time

import torch

from common.rundir import RunDir, cuda_peak
from common.stopping import StopRequests, check_weights
from common.terminal import progress_bar


class Bookkeeping:
    """What every training loop does after its optimizer steps, the same in the plain and the wrapped script:
    count the step (`state["step"]`), move the progress bar, log every `log_every` steps, let the ranks decide
    together whether to stop (`stop`, a StopRequests), and check the weights before each checkpoint. The
    loop itself (data, forward, backward, optimizer steps) and the saving stay in the script:

        loop = Bookkeeping(config, state, run, stop, "gan", config.batch_size * world_size)
        for step, batch in batches(loader, state["step"]):
            ...                                                  # the training step
            if loop.end_step(step, loss, lambda: {"loss": loss.item()}):
                break                                            # every rank stops after this step
            if loop.checkpoint_due():
                fabric.save(run.checkpoint, state)
        loop.close()
        fabric.save(run.checkpoint, state)
        if stop.reason:
            return stop.report(run, state["step"])
    """

    def __init__(self, config, state: dict, run: RunDir, stop: StopRequests, name: str, examples_per_step: int):
        """`examples_per_step`: what one step trains on across all processes (images, or tasks for MAML), for
        the throughput in each record."""
        self.config, self.state, self.run, self.stop = config, state, run, stop
        self.examples_per_step = examples_per_step
        self.progress = progress_bar(total=config.max_steps, initial=state["step"], disable=not run.write, desc=name)
        self._since = (state["step"], time.perf_counter())  # the last log step and its time

    def end_step(self, step: int, loss: torch.Tensor, metrics) -> bool:
        """After step `step`: True when the ranks agreed to stop (save, then `stop.report`). On log steps
        (every `log_every`, and the last) the loss is checked on every rank, and `metrics()` (a dict of
        numbers, called only then: `.item()` waits for the device) is written to metrics.jsonl."""
        self.state["step"] = step + 1
        self.progress.update()
        log = self.state["step"] % self.config.log_every == 0 or self.state["step"] == self.config.max_steps
        stopping = self.stop.check(step, loss if log else None, self.run.checkpoint)
        if log:
            record = {**metrics(), **self._throughput()}  # after metrics(): its .item() waits for the device
            self.run.log({"step": self.state["step"], **record})
        return stopping

    def _throughput(self) -> dict:
        """Examples per second since the last log step (wall time: everything the loop did in between), and on
        CUDA the peak memory the allocator has held so far."""
        (last_step, last_time), now = self._since, time.perf_counter()
        self._since = (self.state["step"], now)
        record = {"examples_per_s": round((self.state["step"] - last_step) * self.examples_per_step
                                          / max(now - last_time, 1e-9), 1)}
        return {**record, **cuda_peak()}

    def checkpoint_due(self) -> bool:
        """True every `checkpoint_every` steps, once the weights are checked (a FloatingPointError if any is
        not finite, so a diverged update never overwrites the last good checkpoint)."""
        if not (self.config.checkpoint_every and self.state["step"] % self.config.checkpoint_every == 0):
            return False
        check_weights(self.state, self.state["step"], self.run.checkpoint)
        return True

    def close(self) -> None:
        """After the loop, before the final checkpoint: close the progress bar, let signals act at once
        again, and check the weights."""
        self.progress.close()
        self.stop.close()
        self.run.finalize()
        check_weights(self.state, self.state["step"], self.run.checkpoint)
