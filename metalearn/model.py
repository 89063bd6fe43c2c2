"""The learner's network: an MLP (the MAML paper's sinusoid net is 2 hidden layers of 40 ReLU units)."""
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features: int = 1, hidden: int = 40, out_features: int = 1, layers: int = 2):
        super().__init__()
        sizes = [in_features] + [hidden] * layers
        blocks = []
        for a, b in zip(sizes, sizes[1:]):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.Linear(sizes[-1], out_features))

    def forward(self, x):  # (B, in_features) -> (B, out_features)
        return self.net(x)

    def forward_tasks(self, params: dict, x):  # (T, B, in_features) -> (T, B, out_features)
        """The same network with one set of weights per task: `params` maps each parameter's name to a
        (T, *shape) tensor, and each layer is x @ W.T + b for all T tasks at once (one batched matmul)."""
        linears = [name for name, module in self.net.named_children() if isinstance(module, nn.Linear)]
        for i, name in enumerate(linears):
            weight, bias = params[f"net.{name}.weight"], params[f"net.{name}.bias"]
            x = torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))
            if i < len(linears) - 1:
                x = x.relu()
        return x
