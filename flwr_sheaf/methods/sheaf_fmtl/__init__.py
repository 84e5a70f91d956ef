"""Sheaf-FMTL: a parameter-space sheaf Laplacian between the agents' models (notes/baselines-sheaf-fmtl.md, s8)."""

ACTION = "sheaf_fmtl"

# its message vocabulary (shared names: flwr_sheaf.protocol, flwr_sheaf.methods._shared.protocol)
#: the neighbours' ``P_ji theta_j`` (key ``str(j)``, ``(d_ij,)``) in a train message (a reply's ``UPLOAD``: its own).
SHEAF_FMTL_PROJECTIONS = "sheaf-fmtl-projections"
#: config entries: the node's neighbours, their d_ij (same order) and the n_i the server assumed.
SHEAF_FMTL_NEIGHBOURS = "sheaf-fmtl-neighbours"
SHEAF_FMTL_DIMS = "sheaf-fmtl-dims"
SHEAF_FMTL_NUM_PARAMS = "sheaf-fmtl-num-params"

from ...config import ConfigError, RunConfig  # noqa: E402
from ...models.zoo import build_agent, count_parameters, zoo_specs  # noqa: E402
from ...topology import build_graph  # noqa: E402
from ..registry import Method, graph_args, register  # noqa: E402
from .client import register_sheaf_fmtl_handlers  # noqa: E402
from .config import SheafFMTLConfig  # noqa: E402
from .strategy import SheafFMTL, sheaf_fmtl_budget  # noqa: E402


def zoo_parameter_counts(zoo: str) -> dict[int, int]:
    """``{partition-id: n_i}`` trainable parameters of every agent of ``zoo`` (built on CPU, no node contacted).

    Raises:
        ConfigError: an unknown zoo (named).
    """
    try:
        specs = zoo_specs(zoo)
    except ValueError as exc:
        raise ConfigError(f"zoo={zoo!r}: {exc}") from None
    return {i: count_parameters(build_agent(s, seed=0)) for i, s in enumerate(specs)}


def build(c: RunConfig, n: int) -> SheafFMTL:
    """Sheaf-FMTL with the zoo's parameter counts; its map memory is checked before any node is contacted.

    Raises:
        ConfigError: the largest node's float16 maps exceed ``sheaf-fmtl-max-gib`` (sizes named).
    """
    counts = zoo_parameter_counts(c.scenario.zoo)
    specs = zoo_specs(c.scenario.zoo)
    sheaf_fmtl_budget(
        counts,
        build_graph(c.federation.graph, len(specs), class_sets=[s.classes for s in specs]),
        c.section(SheafFMTLConfig),
    )
    return SheafFMTL(n, num_params=counts, sheaf_fmtl=c.section(SheafFMTLConfig), **graph_args(c))


METHOD = register(Method("sheaf-fmtl", ACTION, build, register_sheaf_fmtl_handlers))
