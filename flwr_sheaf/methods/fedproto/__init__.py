"""FedProto (Tan et al. 2022): class prototypes averaged over the graph (notes/baselines-prototypes.md)."""

ACTION = "fedproto"

from ..registry import Method, graph_args, register  # noqa: E402
from .client import register_fedproto_handlers  # noqa: E402
from .config import FedProtoConfig  # noqa: E402
from .strategy import FedProto  # noqa: E402

METHOD = register(
    Method(
        "fedproto",
        ACTION,
        lambda c, n: FedProto(n, fedproto=c.section(FedProtoConfig), **graph_args(c)),
        register_fedproto_handlers,
        report_keys=("fedproto-lambda",),
    )
)
