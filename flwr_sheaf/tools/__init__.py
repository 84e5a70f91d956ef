"""Tools installed with the package (the top layer: they use the apps, nothing imports them):
:mod:`~flwr_sheaf.tools.deploy_local` (console entry point ``flwr-sheaf-deploy``, docs/deployment.md),
:mod:`~flwr_sheaf.tools.flwr_cli` (driving the ``flwr`` CLI) and :mod:`~flwr_sheaf.tools.ray_cluster`
(which Ray cluster a simulation gets). The first two need the optional ``deploy`` extra
(``pip install 'flwr-sheaf[deploy]'``), named when missing.
"""
