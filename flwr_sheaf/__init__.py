"""flwr-sheaf: sheaf-based heterogeneous federated representation learning (Sheaf-FRL) for Flower.

The public API in one import::

    from flwr_sheaf import SheafFRL, register_sheaf_handlers, LocalTask, LocalGrid, SheafConfig, write_results

Layers, dependencies pointing one way (docs/design.md): maths (``sheaf``, ``models``, ``data``,
``topology``) <- core (``config``, ``protocol``, ``client``, ``strategy``; no method named) <-
``methods`` (one unit per method) <- ``apps`` (the ``flwr run`` app) <- ``tools``.
"""

from .client.handlers import ClientMethod, register_method_handlers
from .client.loop import CrossEntropy, LossPlugin, train_local
from .client.task import LocalTask, TaskFactory
from .config import ConfigError, FederationConfig, LocalTrainConfig, RunConfig, ScenarioConfig
from .methods import METHODS, Method, get_method, register
from .methods.comfed.client import register_comfed_handlers
from .methods.comfed.config import ComFedConfig
from .methods.comfed.strategy import ComFed
from .methods.fedmuscle.client import register_fedmuscle_handlers
from .methods.fedmuscle.config import FedMuscleConfig
from .methods.fedmuscle.strategy import FedMuscle
from .methods.fedproto.client import register_fedproto_handlers
from .methods.fedproto.config import FedProtoConfig
from .methods.fedproto.strategy import FedProto
from .methods.fedsaf.client import register_fedsaf_handlers
from .methods.fedsaf.config import FedSAFConfig
from .methods.fedsaf.strategy import FedSAF
from .methods.noncooperative.client import register_noncooperative_handlers
from .methods.noncooperative.strategy import NonCooperative
from .methods.rfedags.client import register_rfedags_handlers
from .methods.rfedags.strategy import RFedAGS
from .methods.sheaf_fmtl.client import register_sheaf_fmtl_handlers
from .methods.sheaf_fmtl.config import SheafFMTLConfig
from .methods.sheaf_fmtl.strategy import SheafFMTL
from .methods.sheaf_frl.client import register_sheaf_handlers
from .methods.sheaf_frl.config import SheafConfig
from .methods.sheaf_frl.strategy import SheafFRL
from .participation import ParticipationSampler, parse_participation
from .results import check_results_dir, write_results
from .sheaf.whitening import Colouring, Whitening
from .strategy.graph import GraphStrategy
from .strategy.records import RoundRecord
from .testing import LocalGrid

__all__ = [
    "SheafFRL",
    "NonCooperative",
    "FedProto",
    "FedSAF",
    "FedMuscle",
    "ComFed",
    "SheafFMTL",
    "RFedAGS",
    "GraphStrategy",
    "RoundRecord",
    "register_sheaf_handlers",
    "register_noncooperative_handlers",
    "register_fedproto_handlers",
    "register_fedsaf_handlers",
    "register_fedmuscle_handlers",
    "register_comfed_handlers",
    "register_sheaf_fmtl_handlers",
    "register_rfedags_handlers",
    "register_method_handlers",
    "ClientMethod",
    "LossPlugin",
    "CrossEntropy",
    "train_local",
    "LocalTask",
    "TaskFactory",
    "Whitening",
    "Colouring",
    "RunConfig",
    "ScenarioConfig",
    "FederationConfig",
    "LocalTrainConfig",
    "SheafConfig",
    "FedProtoConfig",
    "FedSAFConfig",
    "FedMuscleConfig",
    "ComFedConfig",
    "SheafFMTLConfig",
    "ConfigError",
    "ParticipationSampler",
    "parse_participation",
    "LocalGrid",
    "write_results",
    "check_results_dir",
    "Method",
    "METHODS",
    "register",
    "get_method",
]
