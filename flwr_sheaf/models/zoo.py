"""Agent zoos (the paper's App. G Tab. 2 and 3, and a cheap heterogeneous family) and the
builder of a :class:`~flwr_sheaf.models.cnn.SheafAgent` from an :class:`~flwr_sheaf.paper.AgentSpec`.

Zoo names accepted by :func:`zoo_specs`:

* ``"paper-15"``: the 15 agents of Tab. 2 (3,411,690 trainable parameters).
* ``"two-agent:<d>"``: the 2-agent bottleneck pair of Fig. 3 / Tab. 3 at latent size ``d``
  (a positive multiple of 4).
* ``"tiny-<N>"``: ``N >= 2`` small heterogeneous agents (each < 7k parameters, ``d`` in
  {16, 24, 32}, dropout 0.1; 5 or 6 consecutive classes): agent ``i``'s spec depends only on
  ``i``, so ``tiny-M`` is a prefix of ``tiny-N`` for ``M <= N``.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch import nn

from flwr_sheaf.models.cnn import CNNEncoder, MLPHead, SheafAgent
from flwr_sheaf.paper import NUM_CLASSES, PAPER_ZOO_15, AgentSpec, two_agent_bottleneck
from flwr_sheaf.sheaf.whitening import Colouring

__all__ = [
    "build_agent",
    "zoo_specs",
    "zoo_size",
    "count_parameters",
    "TINY_FAMILY",
    "VALID_ZOO_NAMES",
    "MIN_ZOO_AGENTS",
]

#: (encoder channels, head hidden widths) of the tiny family, cycled over agents.
TINY_FAMILY: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((8, 16), ()),
    ((8, 16, 24), (16,)),
    ((12, 24), (24,)),
    ((16, 32), (32,)),
    ((8, 16, 32), ()),
)
TINY_DROPOUT = 0.1

VALID_ZOO_NAMES = "'paper-15', 'two-agent:<d>' (d a positive multiple of 4), 'tiny-<N>' (N >= 1)"


def _tiny_spec(i: int) -> AgentSpec:
    """Spec of agent ``i`` of the tiny family: architecture ``i mod 5``; classes a window of
    ``5 + (i mod 2)`` consecutive labels (mod 10) starting at ``3 i mod 10``."""
    channels, hidden = TINY_FAMILY[i % len(TINY_FAMILY)]
    size = 5 + (i % 2)
    start = (3 * i) % NUM_CLASSES
    classes = tuple(sorted((start + k) % NUM_CLASSES for k in range(size)))
    return AgentSpec(channels, hidden, TINY_DROPOUT, classes)


def zoo_specs(name: str) -> tuple[AgentSpec, ...]:
    """One :class:`~flwr_sheaf.paper.AgentSpec` per agent (partition id = index) of a named zoo
    (names: module docstring), built once per process and name.

    Raises:
        ValueError: unknown name (the valid ones listed), ``N < 1``, or a ``d`` that is not a
            positive multiple of 4.
    """
    if not isinstance(name, str):
        raise ValueError(f"zoo name must be a string, got {name!r}; valid names: {VALID_ZOO_NAMES}")
    return _zoo_specs(name.strip())


def zoo_size(name: str) -> int:
    """Number of agents of a named zoo, read from the name (nothing built).

    Raises:
        ValueError: as :func:`zoo_specs` (unknown name, ``N <`` :data:`MIN_ZOO_AGENTS`, a bad ``d``).
    """
    m = re.fullmatch(r"tiny-(\d+)", str(name).strip())
    if m and int(m.group(1)) >= MIN_ZOO_AGENTS:
        return int(m.group(1))
    return len(zoo_specs(name))  # paper-15, two-agent:<d> (2 agents, d checked) and the errors


#: The fewest agents of a zoo: one agent has no edge, and a sheaf (and every method) compares two.
MIN_ZOO_AGENTS = 2


@functools.lru_cache(maxsize=64)
def _zoo_specs(key: str) -> tuple[AgentSpec, ...]:
    if key == "paper-15":
        return PAPER_ZOO_15
    m = re.fullmatch(r"two-agent:(\d+)", key)
    if m:
        return two_agent_bottleneck(int(m.group(1)))
    m = re.fullmatch(r"tiny-(\d+)", key)
    if m:
        n = int(m.group(1))
        if n < MIN_ZOO_AGENTS:
            raise ValueError(
                f"a zoo of {n} agent{'' if n == 1 else 's'} has no edge, and a sheaf needs at least "
                f"{MIN_ZOO_AGENTS} agents; use tiny-<N> with N >= {MIN_ZOO_AGENTS} (e.g. "
                f"zoo='tiny-{MIN_ZOO_AGENTS}'), two-agent:<d> or paper-15"
            )
        return tuple(_tiny_spec(i) for i in range(n))
    raise ValueError(f"unknown zoo name {key!r}; valid names: {VALID_ZOO_NAMES}")


def build_agent(
    spec: AgentSpec,
    num_classes: int = NUM_CLASSES,
    seed: int | None = None,
    **whitening_kwargs: Any,
) -> SheafAgent:
    """One :class:`SheafAgent` (CPU, float32, train mode) from ``spec`` (paper App. G Tab. 2/3): a
    ``CNNEncoder`` with its ``Whitening`` and an ``MLPHead`` whose colouring inverts it.

    Args:
        spec: the agent's architecture and class set.
        num_classes: number of logits (10 for MNIST).
        seed: if given, weights are drawn from the CPU generator seeded with it inside
            ``torch.random.fork_rng`` (global RNG untouched); ``None``: the global RNG.
        **whitening_kwargs: ``shrinkage``, ``eps``, ``momentum``, ``check_finite`` of the whitening.

    Raises:
        ValueError: a class outside ``[0, num_classes)``, or bad architecture / whitening arguments.
    """
    if not isinstance(spec, AgentSpec):
        raise ValueError(f"spec must be an AgentSpec, got {type(spec).__name__}")
    if not spec.classes or any(not 0 <= c < num_classes for c in spec.classes):
        raise ValueError(
            f"spec.classes={spec.classes} must be non-empty and within [0, num_classes={num_classes})"
        )

    def _make() -> SheafAgent:
        encoder = CNNEncoder(spec.channels, spec.dropout, whitening_kwargs=whitening_kwargs)
        head = MLPHead(spec.d, spec.hidden, spec.dropout, num_classes, Colouring(encoder.whitening))
        return SheafAgent(encoder, head)

    if seed is None:
        return _make()
    with torch.random.fork_rng(devices=[]):
        # the CPU generator only (the weights are drawn on the CPU): torch.manual_seed would also
        # queue a lazy seed of every accelerator, with a stack trace, ~4 ms a model
        torch.default_generator.manual_seed(int(seed))
        return _make()


def count_parameters(module: nn.Module) -> int:
    """Number of trainable parameters (``requires_grad``; shared parameters counted once; BN
    affine weights included, running statistics and whitening buffers excluded)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
