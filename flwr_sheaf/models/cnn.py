"""Parametric CNN encoder, MLP head and the agent that wraps them (paper Sec. 6 "Model
heterogeneity", App. G Tab. 2/Tab. 3; reference architecture: docs/paper.md, s9).

Encoder ``f_phi``: per width ``c`` Conv3x3(pad 1) -> BatchNorm2d -> ReLU -> MaxPool2 -> Dropout2d(p)
(at most 4 blocks for 28x28 inputs), AdaptiveAvgPool2d(1) + flatten (``d = channels[-1]``), then the
whitening layer (paper Sec. 3). Head ``h_psi``: the colouring layer, per hidden width Linear ->
BatchNorm1d -> ReLU -> Dropout(p), then a Linear to the 10 global logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from flwr_sheaf.sheaf.whitening import Colouring, Whitening

if TYPE_CHECKING:
    from flwr_sheaf.sheaf.stalk import StalkModel as _AgentBase
else:
    _AgentBase = nn.Module

__all__ = ["CNNEncoder", "MLPHead", "SheafAgent"]


def _check_widths(widths: Sequence[int], name: str, allow_empty: bool) -> tuple[int, ...]:
    widths = tuple(widths)
    if not widths and not allow_empty:
        raise ValueError(f"{name} must be non-empty, got {name}={widths}")
    for w in widths:
        if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
            raise ValueError(f"{name} must be positive ints, got {name}={widths}")
    return widths


def _check_pos_int(v: int, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={v!r}")
    return v


def _check_dropout(p: float) -> float:
    if not (0.0 <= float(p) < 1.0):
        raise ValueError(f"dropout must lie in [0, 1), got dropout={p}")
    return float(p)


class CNNEncoder(nn.Module):
    """CNN encoder ``f_phi_i`` ending in a whitening layer (paper Sec. 3 and App. G, Tab. 2).

    ``backbone`` maps ``(B, in_channels, H, W)`` to raw post-ReLU latents ``(B, d)``, ``d =
    channels[-1]``; ``whitening`` is ``Whitening(d, **whitening_kwargs)``; Dropout2d(``dropout``)
    follows every block, the last too (as the reference).

    Raises:
        ValueError: empty/non-positive ``channels``, ``dropout`` outside ``[0, 1)``, bad
            ``in_channels`` or bad whitening arguments.
    """

    def __init__(
        self,
        channels: Sequence[int],
        dropout: float,
        in_channels: int = 1,
        whitening_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        channels = _check_widths(channels, "channels", allow_empty=False)
        p = _check_dropout(dropout)
        in_channels = _check_pos_int(in_channels, "in_channels")
        layers: list[nn.Module] = []
        prev = in_channels
        for c in channels:
            layers.append(
                nn.Sequential(
                    nn.Conv2d(prev, c, kernel_size=3, stride=1, padding=1),
                    nn.BatchNorm2d(c),
                    nn.ReLU(inplace=True),
                    nn.MaxPool2d(2),
                    nn.Dropout2d(p),
                )
            )
            prev = c
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(1)]
        self.channels = channels
        self.in_channels = in_channels
        self.d = channels[-1]
        self.backbone = nn.Sequential(*layers)
        self.whitening = Whitening(self.d, **dict(whitening_kwargs or {}))

    def latent(self, x: Tensor) -> Tensor:
        """Raw latents ``z (B, d)`` of images ``x (B, in_channels, H, W)``, in ``x``'s dtype.

        Raises:
            ValueError: if ``x`` is not 4-D with ``in_channels`` channels.
        """
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"x must have shape (B, in_channels={self.in_channels}, H, W), got {tuple(x.shape)}"
            )
        return self.backbone(x)

    def forward(self, x: Tensor) -> Tensor:
        """Whitened latents ``zhat = whitening(backbone(x))`` ``(B, d)`` (train mode: ``B >= 2``)."""
        return self.whitening(self.latent(x))


class MLPHead(nn.Module):
    """MLP head ``h_psi_i``: ``forward(zhat) = mlp(colouring(zhat))`` (paper Sec. 3 and Tab. 2).

    ``mlp`` maps ``(B, d)`` to logits ``(B, num_classes)`` through the ``hidden`` widths (may be
    empty); ``colouring`` is bound to the encoder's whitening (None: ``nn.Identity``).

    Raises:
        ValueError: a non-positive size, ``dropout`` outside ``[0, 1)``, or a colouring of another ``d``.
    """

    def __init__(
        self,
        d: int,
        hidden: Sequence[int],
        dropout: float,
        num_classes: int,
        colouring: Colouring | None,
    ) -> None:
        super().__init__()
        d = _check_pos_int(d, "d")
        hidden = _check_widths(hidden, "hidden", allow_empty=True)
        p = _check_dropout(dropout)
        num_classes = _check_pos_int(num_classes, "num_classes")
        if colouring is not None and colouring.d != d:
            raise ValueError(f"colouring has d={colouring.d} but the head expects d={d}")
        self.d = d
        self.hidden = hidden
        self.num_classes = num_classes
        self.colouring: nn.Module = colouring if colouring is not None else nn.Identity()
        layers: list[nn.Module] = []
        prev = d
        for h in hidden:
            layers += [nn.Linear(prev, h), nn.BatchNorm1d(h), nn.ReLU(inplace=True), nn.Dropout(p)]
            prev = h
        layers.append(nn.Linear(prev, num_classes))
        self.mlp = nn.Sequential(*layers)

    def forward(self, zhat: Tensor) -> Tensor:
        """Logits ``(B, num_classes)`` from whitened latents ``zhat (B, d)``.

        Raises:
            ValueError: if ``zhat`` is not ``(B, d)`` (or is non-finite, via the colouring).
        """
        if zhat.ndim != 2 or zhat.shape[1] != self.d:
            raise ValueError(f"zhat must have shape (B, d={self.d}), got {tuple(zhat.shape)}")
        return self.mlp(self.colouring(zhat))


class SheafAgent(_AgentBase):
    """One Sheaf-FRL agent: encoder ``f_phi_i`` + head ``h_psi_i`` (paper Sec. 3, Sec. 6).

    ``head``'s colouring (if any) must reference ``encoder.whitening`` itself; ``d`` is ``encoder.d``.

    Raises:
        ValueError: if ``head.d != encoder.d`` or the head's colouring inverts a different
            whitening layer.
    """

    def __init__(self, encoder: CNNEncoder, head: MLPHead) -> None:
        super().__init__()
        if head.d != encoder.d:
            raise ValueError(f"head expects d={head.d} but the encoder produces d={encoder.d}")
        if (
            isinstance(head.colouring, Colouring)
            and head.colouring.whitening is not encoder.whitening
        ):
            raise ValueError("head.colouring must reference encoder.whitening (the same object)")
        self.encoder = encoder
        self.head = head
        self.d = encoder.d

    @property
    def whitening(self) -> Whitening:
        """The stalk's whitening layer (``encoder.whitening``), as the sheaf handlers expect."""
        return self.encoder.whitening

    def private_logits(self, x: Tensor) -> Tensor:
        """Private path ``head.mlp(encoder.latent(x))``: logits ``(B, num_classes)`` for images
        ``x (B, C, H, W)`` (paper Eq. 22; skips the whitening/colouring pair, which cancels only
        in eval mode: notes/stability.md, s2.9).

        Raises:
            ValueError: ``x`` not 4-D with the encoder's input channels.
        """
        return self.head.mlp(self.encoder.latent(x))

    def forward(self, x: Tensor) -> Tensor:
        """:meth:`private_logits`: logits ``(B, num_classes)`` for ``x (B, C, H, W)``; raises likewise."""
        return self.private_logits(x)

    def latent(self, x: Tensor) -> Tensor:
        """Raw post-ReLU latents ``(B, d)`` (``encoder.latent``); raises as :meth:`private_logits`."""
        return self.encoder.latent(x)

    def whitened(self, x: Tensor) -> Tensor:
        """Whitened latents ``zhat (B, d)`` = ``encoder(x)`` (pilots, test latents; train mode: ``B >= 2``).

        Raises:
            ValueError: bad image shape, or ``B < 2`` with the whitening in train mode.
        """
        return self.encoder(x)

    def classify_whitened(self, zhat: Tensor) -> Tensor:
        """Logits ``(B, num_classes)`` = ``head(zhat)`` for whitened latents ``zhat (B, d)`` of this
        stalk (communication accuracy, paper Eq. 22).

        Raises:
            ValueError: ``zhat`` not ``(B, d)`` or non-finite."""
        return self.head(zhat)
