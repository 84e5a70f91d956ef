"""Components that several methods hold (not a base class, not a method: nothing here registers).

- :mod:`.prototypes`: class prototypes, their aggregation, the pooling adapter to a common
  dimension and FedProto's prototype loss (maths; FedProto, FedSAF, FedMuscle, ComFed use it);
- :mod:`.prototype_aggregation`: :class:`~.prototype_aggregation.PrototypeAggregator`, the server's
  prototype round (FedProto and FedSAF hold one) and the common dimension of a ``<method>-dim`` key.
"""
