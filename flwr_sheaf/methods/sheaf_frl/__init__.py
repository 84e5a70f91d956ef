"""Sheaf-FRL (the paper's method): gluing on the shared pilots (docs/paper.md)."""

ACTION = "sheaf"

from ...config import declare_default_method  # noqa: E402
from ..registry import Method, graph_args, register  # noqa: E402
from .client import SheafClient, SheafGluing, register_sheaf_handlers  # noqa: E402,F401
from .config import SheafConfig  # noqa: E402
from .strategy import SheafFRL  # noqa: E402

METHOD = register(
    Method(
        "sheaf-frl",
        ACTION,
        lambda c, n: SheafFRL(n, sheaf=c.section(SheafConfig), **graph_args(c)),
        register_sheaf_handlers,
        report_keys=("lambda",),
    )
)
# the method a run config that names none runs (the `method` key's default; the core names none)
declare_default_method(METHOD.name)
