"""An offline quality score: Frechet distance in the feature space of a classifier trained on the real data.

Inception weights cannot be downloaded here, so the features come from a small CNN trained on the
dataset's own labelled training split (cached under ~/.cache/multimodel-suite). The distance itself
is torchmetrics' FrechetInceptionDistance with that CNN as its feature extractor. Beside the score
come its floor (training images vs held-out real images), its ceiling (uniform noise) and the entropy
of the classes the classifier assigns to generated images (ln 10 = 2.303 when all ten digits appear
equally often; low values expose mode collapse).
"""
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from common.files import atomic_write


class Classifier(nn.Module):
    """A small CNN for (C, S, S) images in [-1, 1]. Calling it gives the 128-d penultimate layer divided
    by its root mean square over the real training images, so distances are in units of the real
    features' scale (without it they grow with however large the trained activations happen to be)."""

    num_features = 128  # read by torchmetrics instead of probing the network with a 299 px image

    def __init__(self, channels: int, num_classes: int, image_size: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 32 x S/2 x S/2
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 64 x S/4 x S/4
            nn.Flatten(), nn.Linear(64 * (image_size // 4) ** 2, self.num_features), nn.ReLU())
        self.head = nn.Linear(self.num_features, num_classes)
        self.register_buffer("feature_scale", torch.ones(()))

    def forward(self, images):  # (B, C, S, S) -> (B, 128) features, the FID feature space
        return self.body(images) / self.feature_scale

    def logits(self, images):
        return self.head(self.body(images))


def _cache_path(dataset: str, image_size: int) -> Path:
    root = Path(os.environ.get("SUITE_CACHE", Path.home() / ".cache" / "multimodel-suite"))
    return root / f"classifier-v2-{dataset}-{image_size}.pt"


def train_classifier(train_set, dataset: str, image_size: int, epochs: int = 15, cache: bool = True) -> Classifier:
    """Train (or load from the cache) the feature classifier on the labelled training split."""
    labels = torch.as_tensor([int(y) for _, y in train_set])
    image = train_set[0][0]
    model = Classifier(image.shape[0], int(labels.max()) + 1, image_size)
    path = _cache_path(dataset, image_size)
    if cache and path.is_file():
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval()
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(train_set, batch_size=64, shuffle=True, generator=generator)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        for images, targets in loader:
            loss = F.cross_entropy(model.logits(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        features = torch.cat([model.body(images) for images, _ in DataLoader(train_set, batch_size=256)])
        model.feature_scale.fill_(features.pow(2).mean().sqrt())
    if cache:
        atomic_write(path, lambda f: torch.save(model.state_dict(), f))
    return model.eval()


def _stack(dataset) -> torch.Tensor:
    return torch.stack([image for image, _ in dataset])


class _Given(nn.Module):
    """torchmetrics' feature extractor for features computed already: the Scorer computes the classifier's
    body once per image and takes both the FID's features and the class entropy's logits from it."""

    num_features = Classifier.num_features

    def forward(self, features):
        return features


def _fid():
    from torchmetrics.image.fid import FrechetInceptionDistance

    # rank 0 alone scores its own samples: no all-gather over the run's process group, which under DDP
    # would wait for ranks that never call this (they left after training). The real images' statistics
    # stay across reset(): only the generated side is recomputed.
    return FrechetInceptionDistance(feature=_Given(), sync_on_compute=False, reset_real_features=False)


@torch.no_grad()
def features(classifier: Classifier, images: torch.Tensor) -> torch.Tensor:
    """The FID feature space: (N, C, S, S) images -> (N, 128)."""
    return torch.cat([classifier(chunk.float()) for chunk in images.split(256)])


@torch.no_grad()
def frechet_distance(classifier: Classifier, real: torch.Tensor, fake: torch.Tensor) -> float:
    fid = _fid()
    fid.update(features(classifier, real), real=True)
    fid.update(features(classifier, fake), real=False)
    return float(fid.compute())


def _entropy(logits: torch.Tensor) -> float:
    p = torch.bincount(logits.argmax(1)).double() / len(logits)
    p = p[p > 0]
    return float((p * (1 / p).log()).sum())  # sum p log(1/p): one class gives 0.0, where -sum p log p gives -0.0


@torch.no_grad()
def class_entropy(classifier: Classifier, images: torch.Tensor) -> float:
    """Entropy (nats) of the classes predicted for `images`: ln(10) = 2.303 when all ten are equally common."""
    return _entropy(torch.cat([classifier.logits(chunk.float()) for chunk in images.split(256)]))


class Scorer:
    """The score against one dataset, its fixed parts computed once: the classifier (trained, or read from the
    cache), the training images' feature statistics, and, when first asked for, the floor and the noise figure.
    A run keeps one, so that an evaluation during training costs the generated images' features alone."""

    def __init__(self, train_set, test_set, dataset: str, image_size: int):
        self.classifier = train_classifier(train_set, dataset, image_size)
        self.held_out = _stack(test_set)
        self._fid = _fid()
        self._fid.update(features(self.classifier, _stack(train_set)), real=True)
        self._reference = None

    @torch.no_grad()
    def _distance(self, generated_features: torch.Tensor) -> float:
        self._fid.reset()  # the generated side only
        self._fid.update(generated_features, real=False)
        return float(self._fid.compute())

    def fid(self, generated: torch.Tensor) -> float:
        return self._distance(features(self.classifier, generated))

    def reference(self) -> dict:
        """The floor (held-out real images) and the ceiling (uniform noise), the same for every score."""
        if self._reference is None:
            noise = torch.rand(self.held_out.shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
            self._reference = {"fid_real_floor": self.fid(self.held_out), "fid_noise": self.fid(noise)}
        return self._reference

    @torch.no_grad()
    def quick(self, generated: torch.Tensor) -> dict:
        """What an evaluation during training logs: the FID and the class entropy (one pass of the classifier)."""
        found = features(self.classifier, generated)
        logits = self.classifier.head(found * self.classifier.feature_scale)
        return {"fid_classifier": self._distance(found), "class_entropy": _entropy(logits)}

    def score(self, generated: torch.Tensor) -> dict:
        """Score `generated` (N, C, S, S) in [-1, 1] against the training images, with floor and ceiling.
        N should equal the held-out size so that the floor and the score carry the same small-sample bias."""
        return {**self.quick(generated), **self.reference(), "class_entropy_max": math.log(10)}


def score(generated: torch.Tensor, train_set, test_set, dataset: str, image_size: int) -> dict:
    """Scorer(...).score(generated): one score, its fixed parts computed for it alone."""
    return Scorer(train_set, test_set, dataset, image_size).score(generated)
