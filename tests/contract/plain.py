"""The same program in plain PyTorch: the DDP wrapper, fully_shard, DeepSpeed engines with the config core would
give them, autocast and one GradScaler (torch's recipe for several models), set_epoch, as a user writes them."""
import copy
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from tests.contract.compare import results_of
from tests.contract.programs import make_loader, make_models, make_optimizer, optimizer_params, train


def run_plain(program: dict, strategy: str, precision: str, seed: int, tmp: Path) -> dict:
    import torch.distributed as dist

    distributed = strategy != "single"
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    set_up = build(program, strategy, precision, world, seed)
    loader = make_loader(program, world, rank, shard=True, seed=seed)
    ops = PlainOps(strategy, precision, set_up, loader,
                   rebuild=lambda: build(program, strategy, precision, world, seed + 1))
    return train(program, loader, ops, tmp)


def build(program: dict, strategy: str, precision: str, world: int, seed: int) -> list:
    """The program's models, optimizers, schedulers and wrappers: [(model, [optimizers], [schedulers], wrapper)]."""
    engines = strategy.startswith("deepspeed")
    models = make_models(program, seed)
    if precision == "bf16-true" and not engines:  # a DeepSpeed engine converts the module itself
        models = [m.to(torch.bfloat16) for m in models]
    set_up = []
    for index, (model, spec) in enumerate(zip(models, program["models"])):
        raw = [(o, make_optimizer(o["kind"], optimizer_params(model, o["params"], models[index + 1:])))
               for o in spec["optimizers"]]
        wrapper = model
        if strategy == "ddp" and any(p.requires_grad for p in model.parameters()):
            wrapper = nn.parallel.DistributedDataParallel(model)
        elif strategy == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            from torch.distributed.fsdp import register_fsdp_forward_method
            options = {"mesh": init_device_mesh("cpu", (world,))}
            if precision == "bf16-mixed":
                options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                if spec["norm"]:  # bfloat16 BatchNorm weights fail on CPU: the norm in a float32 group of its own
                    fully_shard(model.norm, **{**options, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32)})
            fully_shard(model, **options)
            if spec["marked"]:
                register_fsdp_forward_method(model, "score")
            raw = [(o, make_optimizer(o["kind"], optimizer_params(model, o["params"]))) for o, _ in raw]
        elif strategy.startswith("deepspeed"):
            import deepspeed
            config = {"zero_optimization": {"stage": int(strategy[-1])}, "gradient_clipping": 0.0,
                      "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                      "managed_gradient_accumulation": False, "zero_allow_untested_optimizer": True,
                      "zero_force_ds_cpu_optimizer": False, "steps_per_print": 2**31}
            if precision.startswith("bf16"):  # DeepSpeed's bf16: bfloat16 weights, float32 master weights
                config["bf16"] = {"enabled": True}
            elif precision.startswith("16-"):  # DeepSpeed's fp16: float16 weights, its own dynamic loss scale
                config["fp16"] = {"enabled": True}
            # the scheduler built before the engine schedules the optimizer the engine steps
            optimizers = [opt for _, opt in raw]
            schedulers = [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if o["scheduler"] else None
                          for o, opt in raw]
            wrapper = deepspeed.initialize(model=model, optimizer=optimizers[0] if optimizers else None,
                                           config=config, dist_init_required=False)[0]
            set_up.append((model, optimizers, schedulers, wrapper))
            continue
        schedulers = [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if o["scheduler"] else None for o, opt in raw]
        set_up.append((model, [opt for _, opt in raw], schedulers, wrapper))
    return set_up


class PlainOps:
    """The calls of one iteration, in plain PyTorch."""

    def __init__(self, strategy, precision, set_up, loader, rebuild):
        self.strategy, self.precision, self.loader, self._rebuild = strategy, precision, loader, rebuild
        self.engines = strategy.startswith("deepspeed")
        self.adopt_set_up(set_up)
        self.frozen_model = None
        # one GradScaler for every optimizer, where there is one to step
        self.scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" and any(
            opts for _, opts, _ in self.set_up) else None
        self.stepped = False
        self.release = []  # fsdp modules kept gathered for a penalty's second backward
        self.world = torch.distributed.get_world_size() if strategy != "single" else 1

    def adopt_set_up(self, set_up):
        self.set_up = [(model, opts, scheds) for model, opts, scheds, _ in set_up]
        self.wrappers = [wrapper for *_, wrapper in set_up]

    def rebuild(self):
        """New models, optimizers, schedulers and wrappers (other initial weights); the scaler stays the user's."""
        self.adopt_set_up(self._rebuild())

    def start_epoch(self, epoch):
        for sampler in (self.loader.sampler, getattr(self.loader.batch_sampler, "sampler", None)):
            if isinstance(sampler, DistributedSampler):
                sampler.set_epoch(epoch)

    def zero_grad(self, i, set_to_none):
        if not self.engines:  # an engine's step clears its gradients itself
            for opt in self.set_up[i][1]:
                opt.zero_grad(set_to_none=set_to_none)

    def forward(self, i, x, marked):
        model = self.set_up[i][0]
        call = model if self.frozen_model == i else self.wrappers[i]  # frozen: around the DDP wrapper
        if marked:  # the method's own work, run through the DDP wrapper's forward (fully_shard: registered)
            call = model.score if call is model or self.strategy == "fsdp" else (lambda x, call=call: 2 * call(x))
        if self.precision == "bf16-true" or (self.engines and self.precision.startswith("bf16")):
            return call(x.to(torch.bfloat16)).float()
        if self.engines and self.precision.startswith("16-"):
            return call(x.to(torch.float16)).float()
        if self.precision in ("bf16-mixed", "16-mixed"):
            with torch.autocast("cpu", dtype=torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16):
                return call(x).float()
        return call(x)

    def evaluate(self, i, x, marked):
        model = self.wrappers[i]
        model.eval()
        with torch.no_grad():
            out = self.forward(i, x, marked)
        model.train()
        return out.detach().float().clone()

    @contextmanager
    def frozen(self, i):
        params = [p for p in self.set_up[i][0].parameters() if p.requires_grad]
        for p in params:
            p.requires_grad_(False)
        self.frozen_model = i
        try:
            yield
        finally:
            self.frozen_model = None
            for p in params:
                p.requires_grad_(True)

    @contextmanager
    def no_sync(self, indices):
        with ExitStack() as stack:
            for i in indices:
                wrapper = self.wrappers[i]
                if isinstance(wrapper, nn.parallel.DistributedDataParallel):
                    stack.enter_context(wrapper.no_sync())
                elif self.strategy == "fsdp":
                    wrapper.set_requires_gradient_sync(False)
                    stack.callback(wrapper.set_requires_gradient_sync, True)
            yield

    def backward(self, loss, i, owner):  # `owner`: core's model=, which plain PyTorch does not need
        if self.engines:
            return self.wrappers[i].backward(loss)
        if self.scaler is not None:
            self.update_scale()
            loss = self.scaler.scale(loss)
        loss.backward()

    def grad(self, output, x, i, owner):
        if self.strategy == "fsdp":  # keep the gathered parameters for the second backward, until the step
            model, optimizers, _ = self.set_up[i]
            shards = [m for m in model.modules() if hasattr(m, "set_reshard_after_backward")]
            for shard in shards:
                shard.set_reshard_after_backward(False, recurse=False)
            self.release.extend(shards)
        if self.scaler is None:
            return torch.autograd.grad(output, x, create_graph=True)[0]
        self.update_scale()
        return torch.autograd.grad(self.scaler.scale(output), x, create_graph=True)[0] / self.scaler.get_scale()

    def update_scale(self):
        if self.stepped:  # the update after the previous backward's steps
            self.scaler.update()
            self.stepped = False

    def clip(self, i, how):
        model, optimizers, _ = self.set_up[i]
        for opt in optimizers:
            if self.scaler is not None:
                self.scaler.unscale_(opt)
            params = [p for g in opt.param_groups for p in g["params"]]
            if how == "norm":
                torch.nn.utils.clip_grad_norm_(params, 0.05)
            elif any(p.grad is not None for p in params):
                torch.nn.utils.clip_grad_value_([p for p in params if p.grad is not None], 0.01)

    def step(self, i):
        if self.engines:
            return self.wrappers[i].step()
        for opt in self.set_up[i][1]:
            # GradScaler.step asserts on an optimizer without gradients (its layers frozen): stepped directly
            if self.scaler is not None and any(p.grad is not None for g in opt.param_groups for p in g["params"]):
                self.scaler.step(opt)
                self.stepped = True
            else:
                opt.step()

    def end_of_steps(self):
        for shard in self.release:
            shard.reshard()
            shard.set_reshard_after_backward(True, recurse=False)
        self.release = []

    def save(self, path):
        if self.engines:
            for i, engine in enumerate(self.wrappers):
                engine.save_checkpoint(str(path), tag=f"model{i}")
            self.snapshot = [[s.state_dict() if s else None for s in scheds] for _, _, scheds in self.set_up]
            return
        if self.scaler is not None:
            self.update_scale()
        models = [model_state(self.strategy, m) for m, _, _ in self.set_up]
        if self.world > 1:  # as a checkpoint rank 0 writes and every rank reads: a buffer each rank keeps its own
            from torch.distributed.tensor import DTensor
            for state in models:  # of (BatchNorm's running statistics) comes back as rank 0's
                for key, value in state.items():
                    if not isinstance(value, DTensor):
                        state[key] = value.clone()
                        torch.distributed.broadcast(state[key], src=0)
        self.snapshot = copy.deepcopy((
            models,
            [[optimizer_state(self.strategy, m, o) for o in opts] for m, opts, _ in self.set_up],
            [[s.state_dict() if s else None for s in scheds] for _, _, scheds in self.set_up],
            self.scaler.state_dict() if self.scaler is not None else None))

    def load(self, path):
        if self.engines:
            for i, engine in enumerate(self.wrappers):
                engine.load_checkpoint(str(path), tag=f"model{i}")
            for (_, _, scheds), states in zip(self.set_up, self.snapshot):
                for s, state in zip(scheds, states):
                    if s is not None:
                        s.load_state_dict(state)
            return
        models, optimizers, schedulers, scaler = copy.deepcopy(self.snapshot)
        for (m, opts, scheds), mstate, ostates, sstates in zip(self.set_up, models, optimizers, schedulers):
            load_model_state(self.strategy, m, mstate)
            for o, state in zip(opts, ostates):
                load_optimizer_state(self.strategy, m, o, state)
            for s, state in zip(scheds, sstates):
                if s is not None:
                    s.load_state_dict(state)
        if self.scaler is not None:
            self.update_scale()
            self.scaler.load_state_dict(scaler)

    def reduce(self, losses):
        if self.world == 1:
            return {"mean": losses.clone(), "broadcast": losses.tolist()}
        mean = losses.clone()
        torch.distributed.all_reduce(mean)
        box = [losses.tolist()]
        torch.distributed.broadcast_object_list(box, src=self.world - 1)
        return {"mean": mean / self.world, "broadcast": box[0]}

    def adopt(self, model, optimizers) -> int:
        """As CoreOps.adopt (one process only: the copy is its own wrapper)."""
        self.set_up.append((model, optimizers, [None] * len(optimizers)))
        self.wrappers.append(model)
        return len(self.set_up) - 1

    def drop(self, k):
        del self.set_up[k], self.wrappers[k]

    def weights(self, i):
        return self.set_up[i][0].state_dict()

    def results(self):
        return results_of(self.strategy, [(m, opts, w) for (m, opts, _), w in zip(self.set_up, self.wrappers)])


def model_state(strategy, model):
    if strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(model)
    return model.state_dict()


def load_model_state(strategy, model, state):
    if strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        return set_model_state_dict(model, state)
    model.load_state_dict(state)


def optimizer_state(strategy, model, optimizer):
    if strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return get_optimizer_state_dict(model, optimizer)
    return optimizer.state_dict()


def load_optimizer_state(strategy, model, optimizer, state):
    if strategy == "fsdp" and not state["state"]:  # saved before the first step: torch's loader refuses it
        optimizer.state.clear()
        for group, saved in zip(optimizer.param_groups, state["param_groups"]):
            group.update({key: value for key, value in saved.items() if key != "params"})
    elif strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        return set_optimizer_state_dict(model, optimizer, state)
    optimizer.load_state_dict(state)
