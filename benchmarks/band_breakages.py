"""Run the main job under one CPU-kernel variant or one patched breakage, for the expected band's
records (benchmarks/records/expected-band.md): the code is patched at run time, in this process;
nothing in the package changes.

    python benchmarks/band_breakages.py NAME key=value ...   # key=value as for simulations/inprocess.py

NAME is one of :data:`PATCHES`. The results directory's ``results.json`` is the run's; the headline
numbers are read from it by ``scripts/expected_band.py --breakage NAME=DIR``. ATEN_CPU_CAPABILITY
(``default``, ``avx2``, ``avx512``) is an environment variable read when torch loads: set it on the
command line of this script or of simulations/inprocess.py.
"""

from __future__ import annotations

import runpy
import sys
import zlib
from pathlib import Path

import torch

import flwr_sheaf.client.common as common
import flwr_sheaf.methods.sheaf_frl.client as frl_client
import flwr_sheaf.sheaf.variants as variants


def _mkldnn_off() -> None:
    torch.backends.mkldnn.enabled = False


def _identity_maps() -> None:
    # training's restriction maps (Eq. 18) replaced by the (d_h, d_t) identity; evaluation keeps its own fit
    variants.procrustes = lambda a_head, a_tail: torch.eye(
        a_head.shape[1], a_tail.shape[1], dtype=a_head.dtype, device=a_head.device
    )


def _gluing(scale: float) -> None:
    real = frl_client.gluing_penalty_terms

    def patched(a_i, terms, lam, check_finite=True):
        pen, per_edge = real(a_i, terms, abs(lam), check_finite=check_finite)
        return scale * pen, per_edge

    frl_client.gluing_penalty_terms = patched


def _lr_tenth() -> None:
    real = torch.optim.SGD

    class SGD(real):  # type: ignore[misc, valid-type]
        def __init__(self, params, lr=1e-3, **kw):
            super().__init__(params, lr=lr / 10, **kw)

    torch.optim.SGD = SGD  # type: ignore[misc]


def _task_patch(change) -> None:
    real = common.to_device

    def patched(task, device):
        out = real(task, device)
        # one fixed draw per node (its class set names it): the same on every message
        gen = torch.Generator().manual_seed(zlib.crc32(repr(task.classes).encode()))
        return change(out, gen)

    common.to_device = patched


def _pilots_permuted() -> None:
    import dataclasses

    def change(task, gen):
        perm = torch.randperm(task.x_pilot.shape[0], generator=gen).to(task.x_pilot.device)
        return dataclasses.replace(task, x_pilot=task.x_pilot[perm])

    _task_patch(change)


def _labels_shuffled() -> None:
    import dataclasses

    def change(task, gen):
        perm = torch.randperm(task.y_train.shape[0], generator=gen).to(task.y_train.device)
        return dataclasses.replace(task, y_train=task.y_train[perm])

    _task_patch(change)


#: Name -> (what it does, the patch).
PATCHES = {
    "mkldnn-off": ("CPU variant: torch.backends.mkldnn.enabled = False", _mkldnn_off),
    "identity-maps": (
        "breakage: training's restriction maps forced to the identity (evaluation still fits its own)",
        _identity_maps,
    ),
    "no-gluing": (
        "breakage: the gluing penalty's value ignored (multiplied by 0, i.e. lambda silently 0)",
        lambda: _gluing(0.0),
    ),
    "gluing-sign": ("breakage: the gluing penalty's sign flipped", lambda: _gluing(-1.0)),
    "lr-tenth": ("breakage: every SGD optimiser gets a tenth of the configured lr", _lr_tenth),
    "pilots-permuted": (
        "breakage: each node's pilot rows in its own order (pilots differ between nodes)",
        _pilots_permuted,
    ),
    "labels-shuffled": (
        "breakage: each node's training labels shuffled across its samples",
        _labels_shuffled,
    ),
}


def main(argv: list[str]) -> None:
    """Apply ``argv[0]``'s patch, then run simulations/inprocess.py with ``argv[1:]``."""
    if not argv or argv[0] not in PATCHES:
        sys.exit(f"band_breakages.py: give one of {', '.join(PATCHES)} then key=value ...")
    print(f"[band_breakages] {argv[0]}: {PATCHES[argv[0]][0]}", file=sys.stderr, flush=True)
    PATCHES[argv[0]][1]()
    script = Path(__file__).resolve().parents[1] / "simulations" / "inprocess.py"
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
