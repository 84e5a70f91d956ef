"""The stalk protocol: what the sheaf handlers need of an agent's model (no Flower, no CNNs).

- ``model.d``: stalk dimension d_i (int);
- ``model.private_logits(x) -> (B, C)``: the private path h_i(f_i(x));
- ``model.latent(x) -> (B, d_i)``: the *raw* latents f_i(x), before any whitening;
- ``model.whitening``: a :class:`flwr_sheaf.sheaf.whitening.Whitening` ``(d_i)``;
- ``model.classify_whitened(zhat) -> (B, C)``: colour whitened latents, then the head.

:class:`StalkModel` is that protocol for type checkers; at run time it is ``nn.Module`` (no
subclassing needed). The CNN zoo (:mod:`flwr_sheaf.models`) implements it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

__all__ = ["StalkModel"]

if TYPE_CHECKING:
    from .whitening import Whitening

    class StalkModel(nn.Module):
        """The stalk protocol (module docstring) as type checkers see ``LocalTask.model``."""

        d: int

        @property
        def whitening(self) -> Whitening: ...

        def private_logits(self, x: torch.Tensor) -> torch.Tensor: ...

        def latent(self, x: torch.Tensor) -> torch.Tensor: ...

        def classify_whitened(self, zhat: torch.Tensor) -> torch.Tensor: ...
else:
    StalkModel = nn.Module
