"""The learner's network: an MLP (the MAML paper's sinusoid net is 2 hidden layers of 40 ReLU units)."""
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
