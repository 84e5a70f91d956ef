"""Data: image sources (:mod:`~flwr_sheaf.data.sources`), the paper's label-shift partition (Eq. 23)
and shared pilots (:mod:`~flwr_sheaf.data.partition`)."""
