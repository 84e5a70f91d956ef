"""Constants of the Sheaf-FRL paper's experiments: Tab. 2 (15-agent zoo, Fig. 2) and App. G / Tab. 3
(2-agent bottleneck sweep, Fig. 3); docs/paper.md, s8-s9.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AgentSpec",
    "PAPER_ZOO_15",
    "PAPER_CLASS_SETS_15",
    "NUM_CLASSES",
    "two_agent_bottleneck",
]

NUM_CLASSES = 10


@dataclass(frozen=True)
class AgentSpec:
    """Architecture and data profile of one agent.

    Attributes:
        channels: output widths of the conv blocks; the stalk dimension is ``d = channels[-1]``.
        hidden: widths of the head's hidden layers (may be empty).
        dropout: dropout probability p used in every encoder block and head layer.
        classes: the agent's target class set C_i (paper Eq. 23), sorted, non-empty.
    """

    channels: tuple[int, ...]
    hidden: tuple[int, ...]
    dropout: float
    classes: tuple[int, ...]

    @property
    def d(self) -> int:
        """Stalk (latent) dimension d_i = last encoder width."""
        return self.channels[-1]


# Paper Tab. 2 (total 3,411,690 trainable parameters).
PAPER_ZOO_15: tuple[AgentSpec, ...] = (
    AgentSpec((32, 64, 128), (256, 128, 64), 0.30, (4, 5, 6, 7, 8)),
    AgentSpec((32, 64, 128, 224), (120,), 0.10, (0, 1, 2, 3, 4)),
    AgentSpec((16, 32, 64), (128,), 0.20, (0, 1, 2, 3, 4, 5)),
    AgentSpec((64, 128, 128), (256, 128), 0.25, (4, 5, 6, 7, 8, 9)),
    AgentSpec((32, 48, 96, 192), (192, 96), 0.30, (0, 1, 2, 7, 8, 9)),
    AgentSpec((24, 48, 96), (96,), 0.15, (2, 3, 4, 5, 6)),
    AgentSpec((32, 64, 128, 256), (256,), 0.40, (1, 2, 3, 4, 5, 6)),
    AgentSpec((24, 48, 96, 144), (64, 32), 0.10, (3, 4, 5, 6, 7)),
    AgentSpec((48, 96, 160), (160, 80), 0.20, (0, 2, 4, 6, 8)),
    AgentSpec((32, 80), (100,), 0.05, (5, 6, 7, 8, 9)),
    AgentSpec((40, 80, 120), (120, 60), 0.20, (1, 2, 3, 4, 5)),
    AgentSpec((48, 96, 192, 240), (256, 128), 0.20, (0, 1, 2, 8, 9)),
    AgentSpec((20, 40, 60, 80), (80,), 0.20, (3, 4, 5, 6, 7, 8)),
    AgentSpec((32, 64, 96), (192, 96), 0.25, (1, 4, 6, 8, 9)),
    AgentSpec((56, 112, 160), (128,), 0.10, (0, 1, 2, 3, 7)),
)

PAPER_CLASS_SETS_15: tuple[tuple[int, ...], ...] = tuple(a.classes for a in PAPER_ZOO_15)


def two_agent_bottleneck(d: int) -> tuple[AgentSpec, AgentSpec]:
    """The paper's 2-agent bottleneck family (Fig. 3) at latent size ``d``.

    Agent 0: encoder [d/4, d/2, d], head [d/2, d/4], p = 0.3, classes {4..9};
    agent 1: encoder [d/2, d], head [d/2], p = 0.1, classes {0..5} (docs/paper.md, s9).

    Raises:
        ValueError: if ``d`` is not a positive multiple of 4.
    """
    if d <= 0 or d % 4:
        raise ValueError(f"bottleneck d must be a positive multiple of 4, got d={d}")
    return (
        AgentSpec((d // 4, d // 2, d), (d // 2, d // 4), 0.3, (4, 5, 6, 7, 8, 9)),
        AgentSpec((d // 2, d), (d // 2,), 0.1, (0, 1, 2, 3, 4, 5)),
    )
