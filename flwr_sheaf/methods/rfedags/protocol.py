"""The RFedAGS family's message vocabulary (the core's names are in :mod:`flwr_sheaf.protocol`)."""

from __future__ import annotations

__all__ = [
    "STREAM_RECORD",
    "LOCAL_STEPS",
    "STEP_SIZE",
    "MINIBATCH_SIZE",
    "PHASE",
    "PHASE_GRADIENT",
    "PHASE_LOCAL",
    "POINT",
    "STREAM",
    "ENDPOINT",
    "FULL_GRADIENT",
    "CORRECTION",
    "MEAN_GRADIENT",
]

#: record of a train reply holding the stream (or, for the baselines, the end point).
STREAM_RECORD = "stream"

# config keys (not run-config keys)
#: local Riemannian SGD steps K of the round.
LOCAL_STEPS = "local-steps"
#: the round's step size alpha_t.
STEP_SIZE = "step-size"
#: local mini-batch size (0 = exact gradients).
MINIBATCH_SIZE = "minibatch-size"
#: RFedAGS baselines: which part of a round a ``train.<baseline>`` message asks for.
PHASE = "phase"
PHASE_GRADIENT, PHASE_LOCAL = "gradient", "local"

# array keys
#: the server point ``x_t`` (float64, the manifold's point shape).
POINT = "x"
#: a client's stream ``zeta`` (float64, same shape as the point).
STREAM = "zeta"
#: RFedAGS baselines: a local end point (RFedProj: ambient ``z^_K``), the server gradient ``g_t`` (RFedSVRG),
#: a client's correction ``c_i`` and mean local gradient ``zeta_i`` (RFedProj).
ENDPOINT = "x-end"
FULL_GRADIENT = "g"
CORRECTION = "c"
MEAN_GRADIENT = "zeta-mean"
