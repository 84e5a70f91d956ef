"""Components several methods hold (nothing here registers): :mod:`.prototypes` (FedProto maths,
pooling adapter) and :mod:`.prototype_aggregation` (the server's prototype round)."""
