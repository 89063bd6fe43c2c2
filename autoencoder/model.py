"""A convolutional autoencoder: Encoder and Decoder grouped under one AutoEncoder module.

Grouping puts both under one strategy wrapper, so one optimizer (with a param group per part)
updates them and every gradient is synchronised. `encode`/`decode` are methods of the group; on a
set-up model, mark them (`model.mark_forward_method("encode")`) so they run through the wrapper.
"""
from torch import nn


class Encoder(nn.Module):
    def __init__(self, channels: int = 1, latent: int = 32, image_size: int = 32, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels, width, 3, 2, 1), nn.GELU(),  # width x S/2 x S/2
            nn.Conv2d(width, 2 * width, 3, 2, 1), nn.GELU(),  # 2 width x S/4 x S/4
            nn.Flatten(), nn.Linear(2 * width * (image_size // 4) ** 2, latent))

    def forward(self, images):  # (B, C, S, S) -> (B, latent)
        return self.net(images)


class Decoder(nn.Module):
    def __init__(self, channels: int = 1, latent: int = 32, image_size: int = 32, width: int = 32):
        super().__init__()
        self.side = image_size // 4
        self.width = width
        self.project = nn.Linear(latent, 2 * width * self.side ** 2)
        self.net = nn.Sequential(
            nn.GELU(),
            nn.ConvTranspose2d(2 * width, width, 4, 2, 1), nn.GELU(),  # width x S/2 x S/2
            nn.ConvTranspose2d(width, channels, 4, 2, 1), nn.Tanh())  # C x S x S, in [-1, 1]

    def forward(self, codes):  # (B, latent) -> (B, C, S, S)
        return self.net(self.project(codes).view(-1, 2 * self.width, self.side, self.side))


class AutoEncoder(nn.Module):
    def __init__(self, channels: int = 1, latent: int = 32, image_size: int = 32, width: int = 32):
        super().__init__()
        if image_size % 4:
            raise ValueError(f"image size must be a multiple of 4, got {image_size}")
        self.encoder = Encoder(channels, latent, image_size, width)
        self.decoder = Decoder(channels, latent, image_size, width)

    def encode(self, images):
        return self.encoder(images)

    def decode(self, codes):
        return self.decoder(codes)

    def forward(self, images):  # (B, C, S, S) -> reconstructions of the same shape
        return self.decoder(self.encoder(images))
