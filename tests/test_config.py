"""Run-config keys: one definition (flwr_sheaf.config), pyproject and docs/run-config.md agree with it, bad input refused.

Every check here is against an independent source: the pyproject/docs text, a hand-written
list of bad values with the key they must name, and a grid that records whether any message left.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.config import (
    DEFAULTS,
    KEYS,
    METHOD_KEYS,
    ConfigError,
    LocalTrainConfig,
    RunConfig,
    ScenarioConfig,
)
from flwr_sheaf.methods.sheaf_frl.config import SheafConfig
from flwr_sheaf.testing import LocalGrid

ROOT = Path(__file__).resolve().parents[1]


def _builtin_defaults() -> dict[str, object]:
    """The app's keys and the built-in method units' own keys (flwr_sheaf/methods/<name>), with defaults."""
    from flwr_sheaf.methods import METHODS

    own = {
        k: METHOD_KEYS[k].default
        for m in METHODS.values()
        if m.config is not None and m.config.__module__.startswith("flwr_sheaf.")
        for k in m.config.keys()
    }
    return {**DEFAULTS, **own}


def test_pyproject_run_config_lists_every_key_with_its_default():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert cfg == _builtin_defaults()


def _docs_table() -> dict[str, object]:
    text = (ROOT / "docs" / "run-config.md").read_text()
    section = text.split("| key | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\|\s*`([a-z0-9-]+)`\s*\|\s*`?(.*?)`?\s*\|", line)
        if m:
            rows[m.group(1)] = tomllib.loads(f"v = {m.group(2)}")["v"]
    return rows


def test_docs_run_config_table_lists_every_key_with_its_default():
    assert _docs_table() == _builtin_defaults()


def test_every_section_field_is_a_key_and_every_key_is_read_somewhere():
    sections = (RunConfig, *(type(getattr(RunConfig(), name)) for name in RunConfig.SECTIONS))
    covered = {k for cls in sections for k in cls.keys()}
    assert covered == set(KEYS)
    assert {type(getattr(RunConfig(), n)) for n in RunConfig.SECTIONS} >= {
        ScenarioConfig,
        SheafConfig,
        LocalTrainConfig,
    }


def test_a_message_config_missing_a_key_is_an_error_not_a_default():
    rec = LocalTrainConfig().to_record()
    del rec["lr"]
    with pytest.raises(ConfigError, match="'lr' missing"):
        LocalTrainConfig.from_record(rec)


BAD = [  # (override, text the error must contain: key and value)
    ({"lambda": -1.0}, "lambda=-1.0"),
    ({"shift": 1.5}, "shift=1.5"),
    ({"shift": -0.1}, "shift=-0.1"),
    ({"participation": "1.2"}, "participation='1.2'"),
    ({"participation": 1.2}, "participation=1.2"),
    ({"fraction-train": 0.0}, "fraction-train=0.0"),
    ({"method": "fedavg"}, "method='fedavg'"),
    ({"graph": "star"}, "graph='star'"),
    ({"graph": "0-1,2-3"}, "not connected"),
    ({"zoo": "paper-16"}, "zoo='paper-16'"),
    ({"dataset": "cifar"}, "dataset='cifar'"),
    ({"num-server-rounds": 2.5}, "num-server-rounds=2.5"),
    ({"local-epochs": 1.9}, "local-epochs=1.9"),
    ({"num-pilots": 99.5}, "num-pilots=99.5"),
    ({"absent-policy": "sometimes"}, "absent-policy='sometimes'"),
    ({"fedproto-dim": "none"}, "fedproto-dim='none'"),
    ({"lr": "fast"}, "lr='fast'"),
    ({"lamda": 0.1}, "did you mean 'lambda'"),
    ({"num-pilots": 1}, "num-pilots=1"),
    (
        {"method": "fedsaf-gcsa", "fedsaf-structure": "rcsa"},
        "fedsaf-structure='rcsa' contradicts method='fedsaf-gcsa'",
    ),
    ({"round-timeout": 0.0}, "round-timeout=0.0"),
]


@pytest.mark.parametrize(
    "override, text", BAD, ids=[next(iter(o)) + "-" + str(i) for i, (o, _) in enumerate(BAD)]
)
def test_bad_run_config_is_refused_before_any_message_is_sent(override, text, tmp_path):
    grid = LocalGrid(cnn_client_app, 15)
    with pytest.raises(ValueError) as info:
        run_server(grid, {**override, "results-dir": str(tmp_path)})
    assert text in str(info.value)
    assert grid.delivered == [] and not (tmp_path / "results.json").exists()


def test_valid_values_parse_to_their_types():
    c = RunConfig.from_run_config(
        {"num-server-rounds": 3.0, "participation": 0.3, "fedproto-dim": "64", "lambda": 1}
    )
    assert c.num_server_rounds == 3 and isinstance(c.num_server_rounds, int)
    assert c.federation.participation == "0.3" and c.fedproto.dim == 64 and c.sheaf.lam == 1.0
    assert c.to_dict()["lambda"] == 1.0 and set(c.to_dict()) == set(KEYS)


def test_section_fields_equal_their_keys():
    """Each section is a plain dataclass (fields written out for type checkers): its field names,
    annotations and defaults must equal its keys' (KEYS / METHOD_KEYS, the one definition)."""
    import dataclasses

    from flwr_sheaf.config import Section, lookup_key
    from flwr_sheaf.methods import METHODS

    def attr(key: str, prefix: str) -> str:
        name = key.removeprefix(prefix).replace("-", "_")
        return "lam" if name == "lambda" else name

    prefixes = {
        "FedProtoConfig": "fedproto-",
        "FedMuscleConfig": "fedmuscle-",
        "ComFedConfig": "comfed-",
        "SheafFMTLConfig": "sheaf-fmtl-",
        "FedSAFConfig": "fedsaf-",
        "RFedAGSConfig": "rfedags-",
    }
    sections: set[type[Section]] = {
        RunConfig,
        *(type(getattr(RunConfig(), n)) for n in RunConfig.SECTIONS),
        *(
            m.config
            for m in METHODS.values()
            if m.config is not None and m.config.__module__.startswith("flwr_sheaf.")
        ),
    }
    for cls in sections:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
        for f in dataclasses.fields(cls):
            if "key" not in f.metadata:
                continue
            key = lookup_key(f.metadata["key"])
            assert f.name == attr(key.name, prefixes.get(cls.__name__, "")), (
                cls.__name__,
                f.name,
                key.name,
            )
            # ``method``'s default is declared by a unit on import: read when a config is made
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            assert default == key.default and type(default) is type(key.default), (
                cls.__name__,
                key.name,
            )
            want = "str | int" if key.name.endswith("-dim") else type(key.default).__name__
            assert f.type == want, (cls.__name__, f.name, f.type, want)
        assert cls.keys() == tuple(
            f.metadata["key"] for f in dataclasses.fields(cls) if "key" in f.metadata
        )


def test_sections_take_keyword_arguments_and_validate():
    s = SheafConfig(pilot_batch_size=8, lam=0.5)
    assert (s.pilot_batch_size, s.lam) == (8, 0.5) and s.to_dict()["pilot-batch-size"] == 8
    with pytest.raises(ConfigError, match="pilot-batch-size=1"):
        SheafConfig(pilot_batch_size=1)
    assert RunConfig.from_run_config({"num-server-rounds": 4}).num_server_rounds == 4


def test_a_mistyped_choice_gets_the_closest_valid_value():
    """A value one keystroke off a valid choice names it (difflib), for the method and for a
    string key with choices; a value close to nothing gets no guess."""
    from flwr_sheaf.config import ConfigError, RunConfig
    from flwr_sheaf.methods import get_method

    with pytest.raises(ConfigError, match=r"method='sheaf_frl'.*\(did you mean 'sheaf-frl'\?\)"):
        get_method("sheaf_frl")
    with pytest.raises(ConfigError, match=r"absent-policy='cahced'.*\(did you mean 'cached'\?\)"):
        RunConfig.from_run_config({"absent-policy": "cahced"})
    with pytest.raises(ConfigError) as err:
        get_method("zzzzzz")
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize("name", ["fedprox", "FedAdam", "fedavg"])
def test_a_flower_strategy_name_as_method_says_so_and_suggests_no_unrelated_method(name):
    """``fedprox`` is one edit from nothing shipped but close in spelling to ``rfedproj`` (a
    Riemannian method): the refusal names Flower's own strategy instead of a misleading guess."""
    import flwr.serverapp.strategy as flower

    from flwr_sheaf.config import ConfigError
    from flwr_sheaf.methods import get_method

    official = next(s for s in flower.__all__ if s.lower() == name.lower())
    with pytest.raises(ConfigError) as err:
        get_method(name)
    text = str(err.value)
    assert "did you mean" not in text
    assert f"{official} is Flower's own strategy, flwr.serverapp.strategy.{official}" in text
    assert hasattr(flower, official)  # the named import path exists
