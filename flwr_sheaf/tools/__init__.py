"""Tools installed with the package (the top layer: they use the apps, nothing imports them).

- :mod:`flwr_sheaf.tools.deploy_local`: Flower's deployment engine on this machine (one SuperLink,
  one SuperNode per site, TLS and SuperNode authentication); console entry point
  ``flwr-sheaf-deploy`` (docs/deployment.md);
- :mod:`flwr_sheaf.tools.flwr_cli`: helpers for driving Flower's ``flwr`` CLI (private
  ``FLWR_HOME``, run status, stopping exactly the processes a tool started).
- :mod:`flwr_sheaf.tools.ray_cluster`: which Ray cluster a ``flwr run`` simulation gets (an existing
  one only when named with ``scripts/run_flwr.py --ray-address``; docs/running.md, "A Ray cluster";
  standard library only).

The first two need the optional ``deploy`` extra (``pip install 'flwr-sheaf[deploy]'``: ``cryptography``,
``psutil``); a missing one is named with that command (:func:`flwr_cli.missing`).
"""
