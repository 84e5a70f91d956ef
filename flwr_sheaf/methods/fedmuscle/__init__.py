"""FedMuscle: contrastive alignment of representations on the shared pilots (notes/baselines-alignment.md, s6)."""

ACTION = "fedmuscle"

# its message vocabulary (shared names: flwr_sheaf.protocol, flwr_sheaf.methods._shared.protocol)
#: FedMuscle: the network averages a node pulls its pilot representations toward (keys below).
MUSCLE_TARGETS = "muscle-targets"
#: a node's pooled pilot representations ``(K, D)`` (in its ``upload``) and the targets ``(K, D)`` it
#: receives in :data:`MUSCLE_TARGETS`: the mean of the other agents' and of all agents' representations.
PILOT_REPS = "pilot-reps"
TARGET_OTHERS = "others"
TARGET_ALL = "all"

from ..registry import Method, graph_args, register  # noqa: E402
from .client import register_fedmuscle_handlers  # noqa: E402
from .config import FedMuscleConfig  # noqa: E402
from .strategy import FedMuscle  # noqa: E402

METHOD = register(
    Method(
        "fedmuscle",
        ACTION,
        lambda c, n: FedMuscle(n, fedmuscle=c.section(FedMuscleConfig), **graph_args(c)),
        register_fedmuscle_handlers,
        report_keys=("fedmuscle-lambda",),
    )
)
