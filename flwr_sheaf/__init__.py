"""flwr-sheaf: sheaf-based heterogeneous federated representation learning (Sheaf-FRL) for Flower.

The public API in one import::

    from flwr_sheaf import SheafFRL, register_sheaf_handlers, LocalTask, LocalGrid, SheafConfig

Layers (dependencies point one way): maths (``sheaf``, ``baselines``, ``rfedags``, ``models``,
``data``, ``topology``; no Flower) <- ``config``, ``protocol``, ``participation`` <- ``client`` and
``strategy`` (never each other) <- ``apps`` (the ``flwr run`` app and the method registry).
"""

from .client.comfed import register_comfed_handlers
from .client.fedmuscle import register_fedmuscle_handlers
from .client.sheaf_fmtl import register_sheaf_fmtl_handlers
from .client.fedproto import register_fedproto_handlers
from .client.fedsaf import register_fedsaf_handlers
from .client.handlers import ClientMethod, register_method_handlers
from .client.loop import CrossEntropy, LossPlugin, train_local
from .client.noncooperative import register_noncooperative_handlers
from .client.rfedags import register_rfedags_handlers
from .client.sheaf import register_sheaf_handlers
from .client.task import LocalTask, TaskFactory
from .config import (ComFedConfig, SheafFMTLConfig, ConfigError, FederationConfig, FedMuscleConfig, FedProtoConfig, FedSAFConfig, LocalTrainConfig, RunConfig,
                     ScenarioConfig, SheafConfig)
from .participation import ParticipationSampler, parse_participation
from .sheaf.whitening import Colouring, Whitening
from .strategy.base import PeerStrategy, RoundRecord
from .strategy.comfed import ComFed
from .strategy.sheaf_fmtl import SheafFMTL
from .strategy.fedmuscle import FedMuscle
from .strategy.fedproto import FedProto
from .strategy.fedsaf import FedSAF
from .strategy.graph import GraphStrategy
from .strategy.noncooperative import NonCooperative
from .strategy.rfedags import RFedAGS
from .strategy.sheaf_frl import SheafFRL
from .testing import LocalGrid

__all__ = [
    "SheafFRL", "NonCooperative", "FedProto", "FedSAF", "FedMuscle", "ComFed", "SheafFMTL", "RFedAGS", "GraphStrategy", "PeerStrategy", "RoundRecord",
    "register_sheaf_handlers", "register_noncooperative_handlers", "register_fedproto_handlers",
    "register_fedsaf_handlers", "register_fedmuscle_handlers", "register_comfed_handlers", "register_sheaf_fmtl_handlers", "register_rfedags_handlers", "register_method_handlers", "ClientMethod",
    "LossPlugin", "CrossEntropy", "train_local", "LocalTask", "TaskFactory", "Whitening", "Colouring",
    "RunConfig", "ScenarioConfig", "FederationConfig", "LocalTrainConfig", "SheafConfig", "FedProtoConfig",
    "FedSAFConfig", "FedMuscleConfig", "ComFedConfig", "SheafFMTLConfig", "ConfigError", "ParticipationSampler", "parse_participation", "LocalGrid",
]
