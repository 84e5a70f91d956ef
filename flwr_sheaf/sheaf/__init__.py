"""Sheaf mathematics on torch tensors (no Flower, no CNNs)."""

from .gluing import EdgeTerm, local_gluing_penalty
from .network import NetworkSheaf, coboundary, orient_edge, path_map, sheaf_laplacian
from .procrustes import polar_factor, procrustes
from .validation import check_pilots

__all__ = [
    "EdgeTerm",
    "local_gluing_penalty",
    "NetworkSheaf",
    "orient_edge",
    "coboundary",
    "sheaf_laplacian",
    "path_map",
    "polar_factor",
    "procrustes",
    "check_pilots",
]
