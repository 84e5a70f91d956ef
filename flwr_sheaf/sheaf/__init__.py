"""Sheaf mathematics on torch tensors (no Flower, no CNNs)."""

from .gluing import EdgeTerm, local_gluing_penalty
from .network import NetworkSheaf, coboundary, orient_edge, path_map, sheaf_laplacian
from .procrustes import SvdCounter, check_pilots, polar_factor, procrustes, svd_count
from .variants import Received, edge_terms, init_map, outgoing_pilots, resolve_variant

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
    "SvdCounter",
    "svd_count",
    "Received",
    "edge_terms",
    "init_map",
    "outgoing_pilots",
    "resolve_variant",
]
