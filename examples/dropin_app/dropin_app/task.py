"""dropin-app: the app's own model, data and train/test loops (what `flwr new` generates).

The only flwr-sheaf addition is at the bottom: ``SheafNet`` (the stalk protocol around ``Net``) and
``sheaf_task`` (what the sheaf handlers need from a node).
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NUM_CLASSES = 10
NUM_PILOTS = 200  # a public, shared set of inputs (the first 200 digits); never used for training


class Net(nn.Module):
    """Small CNN for 8x8 digits: ``features`` (latent of size ``latent_dim``) then ``classifier``."""

    def __init__(self, latent_dim: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(8 * 4 * 4, latent_dim),
            nn.ReLU(),
        )
        self.classifier = nn.Linear(latent_dim, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8), torch.tensor(
        y, dtype=torch.int64
    )


def classes_of(partition_id: int) -> tuple[int, ...]:
    """Node i's main classes: 6 consecutive labels starting at 3 i (mod 10)."""
    return tuple(sorted((3 * partition_id + k) % NUM_CLASSES for k in range(6)))


def partition(partition_id: int, num_partitions: int):
    """Label-skewed split of the non-pilot digits: a digit of class c goes to node i with probability
    proportional to 0.7 [c in classes_of(i)] / 6 + 0.3 / 10. Returns (train, test) tensor pairs."""
    x, y = _digits()
    x, y = x[NUM_PILOTS:], y[NUM_PILOTS:]
    w = np.array(
        [
            [0.7 * (c in classes_of(i)) / 6 + 0.3 / NUM_CLASSES for c in range(NUM_CLASSES)]
            for i in range(num_partitions)
        ]
    )
    w /= w.sum(0, keepdims=True)
    rng = np.random.default_rng(0)
    owner = np.array([rng.choice(num_partitions, p=w[:, c]) for c in y.tolist()])
    idx = np.flatnonzero(owner == partition_id)
    idx = idx[np.random.default_rng(partition_id).permutation(len(idx))]
    n_test = len(idx) // 5
    tr, te = torch.from_numpy(idx[n_test:]), torch.from_numpy(idx[:n_test])
    return (x[tr], y[tr]), (x[te], y[te])


def load_data(partition_id: int, num_partitions: int):
    """Train and test DataLoaders of one partition."""
    (xt, yt), (xs, ys) = partition(partition_id, num_partitions)
    return (
        DataLoader(TensorDataset(xt, yt), batch_size=32, shuffle=True),
        DataLoader(TensorDataset(xs, ys), batch_size=64),
    )


def train(net: nn.Module, loader: DataLoader, epochs: int, lr: float) -> float:
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    total, n = 0.0, 0
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            total, n = total + loss.item() * len(y), n + len(y)
    return total / max(n, 1)


@torch.no_grad()
def test(net: nn.Module, loader: DataLoader) -> tuple[float, float]:
    net.eval()
    loss, correct, n = 0.0, 0, 0
    for x, y in loader:
        out = net(x)
        loss += float(nn.functional.cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
        n += len(y)
    return loss / max(n, 1), correct / max(n, 1)


# ---------------------------------------------------------------------------- flwr-sheaf
from flwr_sheaf import Colouring, LocalTask, Whitening  # noqa: E402


class SheafNet(nn.Module):
    """``Net`` seen as a stalk: latent = ``features``, head = ``classifier`` after a colouring layer."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.net = net
        self.d = net.classifier.in_features
        self.whitening = Whitening(self.d)
        self.colouring = Colouring(self.whitening)

    def latent(self, x):
        return self.net.features(x)

    def private_logits(self, x):
        return self.net(x)

    def classify_whitened(self, zhat):
        return self.net.classifier(self.colouring(zhat))


def sheaf_task(context) -> LocalTask:
    """What the sheaf handlers need from a node: its model (stalk protocol), data and the pilots.

    Called for every message: it rebuilds the model deterministically (seeded by partition-id; the
    handlers then restore the trained weights from ``context.state``). The pilots are the same 200
    digits in the same order on every node.
    """
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    (xt, yt), (xs, ys) = partition(pid, n)
    torch.manual_seed(pid)
    x_pilot = _digits()[0][:NUM_PILOTS]
    half = len(ys) // 2  # the test split halves into validation and test
    return LocalTask(
        SheafNet(Net()),
        xt,
        yt,
        xs[:half],
        ys[:half],
        xs[half:],
        ys[half:],
        x_pilot,
        classes_of(pid),
    )
