"""Issue #28, cases 2, 8, 10 and 11: the method registry and the run config answer early and clearly.

Each test reproduces one case of the issue (it failed before the fix) and checks the message the
user now sees (quoted in docs/guarantees.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flwr_sheaf.config import ConfigError
from flwr_sheaf.methods import (
    METHODS,
    Method,
    import_method_modules,
    parse_run_config,
    register,
    registry,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """A directory on ``sys.path`` for a test's own method modules; every method and module they
    register is removed afterwards (the registry is process-wide)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before_methods, before_mods = set(METHODS), set(sys.modules)
    yield tmp_path
    for name in set(METHODS) - before_methods:
        registry._METHODS.pop(name, None)
        registry._ORIGINS.pop(name, None)
    for mod in set(sys.modules) - before_mods:
        if str(getattr(sys.modules[mod], "__file__", "") or "").startswith(str(tmp_path)):
            del sys.modules[mod]


USER_METHOD = """
from flwr_sheaf.methods import Method, graph_args, register
from flwr_sheaf.methods.noncooperative.client import register_noncooperative_handlers
from flwr_sheaf.methods.noncooperative.strategy import NonCooperative

register(Method({name!r}, {action!r}, lambda c, n: NonCooperative(n, **graph_args(c)),
                register_noncooperative_handlers))
"""


# ------------------------------------------------------------------- case 2: the method registry


def test_a_user_module_named_client_cannot_replace_a_builtin_method(user_modules):
    # before: the registry compared only the last name part of the handlers' module ("client"), so a
    # user's client.py registering "non-cooperative" silently replaced the built-in
    (user_modules / "client.py").write_text(USER_METHOD.format(name="non-cooperative", action="x"))
    builtin = METHODS["non-cooperative"]
    with pytest.raises(ConfigError) as err:
        import_method_modules("client")
    msg = str(err.value)
    assert "method 'non-cooperative' is already registered by module" in msg
    assert "'flwr_sheaf.methods.noncooperative'" in msg and "(a built-in method)" in msg
    assert str(user_modules / "client.py") in msg and "give your method another name" in msg
    assert METHODS["non-cooperative"] is builtin


def test_two_user_modules_registering_one_name_are_refused_naming_both(user_modules):
    (user_modules / "first_method.py").write_text(USER_METHOD.format(name="twin", action="twin1"))
    (user_modules / "second_method.py").write_text(
        USER_METHOD.format(name="twin", action="twin2").replace("\n", "\n# another file\n", 1)
    )
    import_method_modules("first_method")
    first = METHODS["twin"]
    with pytest.raises(ConfigError) as err:
        import_method_modules("first_method,second_method")
    msg = str(err.value)
    assert "module 'first_method'" in msg and "module 'second_method'" in msg
    assert str(user_modules / "second_method.py") in msg and METHODS["twin"] is first


def test_reimporting_the_same_method_file_is_not_a_conflict(user_modules):
    # the same file imported again (e.g. a ServerApp and a ClientApp in one process) keeps its name
    src = USER_METHOD.format(name="again", action="again")
    (user_modules / "again_method.py").write_text(src)
    import_method_modules("again_method")
    del sys.modules["again_method"]
    import_method_modules("again_method")
    assert METHODS["again"].action == "again"


def test_a_syntax_error_in_the_method_module_names_its_file_and_line(user_modules):
    (user_modules / "broken_method.py").write_text("x = 1\ndef f(:\n    pass\n")
    with pytest.raises(ConfigError) as err:
        parse_run_config({"method-module": "broken_method"})
    msg = str(err.value)
    assert f"syntax error in 'broken_method' at {user_modules / 'broken_method.py'}, line 2" in msg
    assert "def f(:" in msg


def test_a_module_whose_import_raises_names_its_file_and_line(user_modules):
    (user_modules / "raising_method.py").write_text("import os\n\nos.environ['NOPE_NOT_SET_X']\n")
    with pytest.raises(ConfigError, match=r"raising_method.py, line 3: KeyError"):
        import_method_modules("raising_method")


def test_a_strategy_raising_in_configure_train_leaves_results_json_with_status_failed(
    user_modules, tmp_path
):
    from flwr_sheaf.apps.client_app import app
    from flwr_sheaf.apps.server_app import run_server
    from flwr_sheaf.methods import graph_args
    from flwr_sheaf.methods.noncooperative.client import register_noncooperative_handlers
    from flwr_sheaf.methods.noncooperative.strategy import NonCooperative
    from flwr_sheaf.testing import LocalGrid

    class Breaks(NonCooperative):
        def configure_train(self, server_round, arrays, config, grid):
            if server_round == 2:
                raise RuntimeError("my strategy broke in round 2")
            return super().configure_train(server_round, arrays, config, grid)

    register(
        Method(
            "breaks-in-round-2",
            "breaks",
            lambda c, n: Breaks(n, action="breaks", **graph_args(c)),
            lambda app, factory: register_noncooperative_handlers(app, factory, action="breaks"),
        )
    )
    out = tmp_path / "res"
    rc = {
        "method": "breaks-in-round-2",
        "zoo": "tiny-3",
        "graph": "complete",
        "num-pilots": 32,
        "max-steps-per-epoch": 2,
        "num-server-rounds": 3,
        "results-dir": str(out),
    }
    with pytest.raises(RuntimeError, match="broke in round 2"):
        run_server(LocalGrid(app, 3, run_config=rc), rc)
    res = json.loads((out / "results.json").read_text())  # before: only checkpoint.pkl was left
    assert res["status"] == "failed" and [r["round"] for r in res["rounds"]] == [1]
    assert res["degradation"]["reasons"] == [
        "the run stopped after server round 1 of 3 (strategy.start did not finish)",
        "RuntimeError: my strategy broke in round 2",
    ]
    assert res["config"]["method"] == "breaks-in-round-2"


# ------------------------------------------------------------------- case 10: typos and ignored keys


@pytest.mark.parametrize(
    "key, typo, meant",
    [
        ("zoo", "tiny3", "tiny-3"),
        ("zoo", "two_agent32", "two-agent:32"),
        ("pilot-strategy", "unifrom:50", "uniform:50"),
        ("partitioner", "dirichlet0.3", "dirichlet:0.3"),
        ("tracking", "tensorbord", "tensorboard"),
    ],
)
def test_a_mistyped_spec_gets_the_closest_valid_one(key, typo, meant):
    with pytest.raises(ConfigError) as err:
        parse_run_config({key: typo})
    assert f"(did you mean {meant!r}?)" in str(err.value)
    parse_run_config({key: meant, "graph": "complete"})  # the suggestion itself is accepted


def test_no_suggestion_for_a_value_close_to_nothing():
    with pytest.raises(ConfigError) as err:
        parse_run_config({"zoo": "bogus"})
    assert "did you mean" not in str(err.value)


def _pyproject_defaults() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def _warnings(**over) -> list[str]:
    from flwr_sheaf.apps.methods import num_nodes
    from flwr_sheaf.methods import run_config_warnings

    rc = {**_pyproject_defaults(), **over}  # as flwr run passes it: every declared key
    cfg, method = parse_run_config(rc)
    n = num_nodes(cfg, method)
    return run_config_warnings(rc, cfg, method, method.strategy(cfg, n))


def test_a_key_of_another_method_and_a_tracker_key_without_its_tracker_are_named():
    assert _warnings(method="fedproto", **{"fedmuscle-lambda": 0.3}) == [
        "fedmuscle-lambda=0.3 (default 1.0) is not read by method='fedproto' and is ignored; it is "
        "read by method='fedmuscle': set method= to that method, or drop fedmuscle-lambda"
    ]
    assert _warnings(**{"tracking-dir": "/tmp/tb"}) == [
        "tracking-dir='/tmp/tb' is ignored: tracking is off (tracking=''); set "
        "tracking='tensorboard' (or 'wandb') to track the run there"
    ]
    # the same keys where they are read: no warning; a preset's own values never warn
    assert _warnings(method="fedmuscle", **{"fedmuscle-lambda": 0.3}) == []
    assert _warnings(**{"tracking-dir": "/tmp/tb", "tracking": "tensorboard"}) == []
    assert _warnings(method="fedproto", preset="paper") == []


def test_panel_and_drawn_at_full_fraction_evaluate_say_they_evaluate_the_same_nodes():
    """At the default fraction-evaluate = 1 a fixed panel and a per-round draw are both every node:
    asking for one of them is said; below 1 (where they differ) and under auto nothing is said."""
    for mode in ("panel", "drawn"):
        (line,) = _warnings(**{"evaluate-nodes": mode, "fraction-train": 0.5})
        assert line.startswith(
            f"evaluate-nodes={mode!r} evaluates every node at fraction-evaluate=1"
        )
        assert "set fraction-evaluate" in line
        assert _warnings(**{"evaluate-nodes": mode, "fraction-evaluate": 0.5}) == []
    assert _warnings(**{"fraction-train": 0.5}) == []  # auto: the trainers


def test_a_key_the_method_does_not_read_names_the_methods_that_do():
    """Issue 34 case 9: ``lambda`` under rfedags, ``rfedags-problem`` under sheaf-frl,
    ``fedmuscle-lambda`` under fedproto: the warning names the key, the method and the methods
    that read the key (from the registry); a key left at its default (as flwr run passes every
    pyproject key) never warns."""
    assert _warnings(method="rfedags", **{"lambda": 0.5}) == [
        "lambda=0.5 (default 0.1) is not read by method='rfedags' and is ignored; it is read by "
        "method='sheaf-frl': set method= to that method, or drop lambda"
    ]
    (w,) = _warnings(**{"rfedags-problem": "spd"})
    assert w.startswith("rfedags-problem='spd' (default 'pca') is not read by method='sheaf-frl'")
    assert "read by method='rfedags' / 'rfedavg' / 'rfedproj' / 'rfedsvrg': set method= to one" in w
    (w,) = _warnings(method="sheaf-frl", **{"fedproto-lambda": 0.5})
    assert "read by method='fedproto' / 'fedsaf-gcsa' / 'fedsaf-rcsa'" in w
    # at its default, or read by the selected method (FedSAF reads FedProto's keys): no warning
    assert _warnings(**{"rfedags-problem": "pca"}) == []
    assert _warnings(method="fedsaf-gcsa", **{"fedproto-lambda": 0.5}) == []


def test_a_client_evaluation_key_under_a_method_without_client_evaluation_is_named():
    # before: method=rfedags took evaluate-nodes (and the other evaluation keys) in silence
    assert _warnings(method="rfedags", **{"evaluate-nodes": "panel", "fraction-evaluate": 0.5}) == [
        f"{k}={v!r} (default {d!r}) is not read by method='rfedags' and is ignored: the method "
        f"evaluates no node; drop {k}"
        for k, v, d in (("evaluate-nodes", "panel", "auto"), ("fraction-evaluate", 0.5, 1.0))
    ]
    assert (
        _warnings(**{"evaluate-nodes": "panel", "fraction-evaluate": 0.5}) == []
    )  # sheaf-frl reads them


def test_key_readers_agree_with_what_each_built_strategy_reads():
    """The registry-derived map equals, for each method, the method-section keys its built strategy
    records (``results.strategy_config``) -- an independent reading of the same fact."""
    from flwr_sheaf.apps.methods import num_nodes
    from flwr_sheaf.config import METHOD_KEYS
    from flwr_sheaf.methods import key_readers
    from flwr_sheaf.results import strategy_config

    readers = key_readers()
    section_keys = set(readers) | set(METHOD_KEYS)
    for name in ("sheaf-frl", "fedproto", "fedsaf-gcsa", "fedmuscle", "comfed", "rfedags"):
        cfg, method = parse_run_config({"method": name})
        n = num_nodes(cfg, method)
        read = set(strategy_config(method.strategy(cfg, n)))
        if cfg.method_section is not None:
            read |= set(cfg.method_section.to_dict())
        claimed = {k for k, ms in readers.items() if name in ms}
        assert claimed == read & section_keys, name


def test_the_default_graph_on_five_agents_is_named_with_its_degrees():
    (w,) = _warnings(zoo="tiny-5")
    assert w.startswith(
        "graph not set: the default graph='class-overlap' (density 0.4) on 5 agents"
    )
    assert "degrees [1, 1, 2, 2, 2]" in w
    assert _warnings(zoo="tiny-5", graph="ring") == [] and _warnings() == []


def test_the_server_app_logs_the_warnings_and_records_them_in_results_json(
    tmp_path, caplog, monkeypatch
):
    import logging

    from flwr_sheaf.apps.client_app import app
    from flwr_sheaf.apps.server_app import run_server
    from flwr_sheaf.testing import LocalGrid

    monkeypatch.chdir(tmp_path)
    rc = {
        "method": "non-cooperative",
        "zoo": "tiny-3",
        "graph": "complete",
        "num-pilots": 32,
        "max-steps-per-epoch": 2,
        "num-server-rounds": 1,
        "results-dir": "res",  # relative: its absolute path is logged (issue #28, seen on the way)
        "lambda": 0.5,
    }
    log = logging.getLogger("flwr_sheaf")  # it does not propagate once the ServerApp set it up
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="flwr_sheaf"):
            path = run_server(LocalGrid(app, 3, run_config=rc), rc)
    finally:
        log.removeHandler(caplog.handler)
    res = json.loads(Path(path).read_text())
    warning = (
        "lambda=0.5 (default 0.1) is not read by method='non-cooperative' and is ignored; it is "
        "read by method='sheaf-frl': set method= to that method, or drop lambda"
    )
    assert res["warnings"] == [warning] and warning in caplog.messages
    assert (
        f"results-dir='res' is relative: results go to {tmp_path.resolve() / 'res'} (the "
        "ServerApp's working directory; under flwr run, where the local SuperLink was first "
        "started: give an absolute path to choose)"
    ) in caplog.messages


# ------------------------------------------------------------------- case 11: scale refusals


@pytest.mark.parametrize(
    "graph, expected",
    [
        ("class-overlap", "builds all N (N-1) / 2 pairs + density of them = 6999930000 edges"),
        ("complete", "builds N (N-1) / 2 = 4999950000 edges, each evaluated both ways; more than "),
    ],
)
def test_a_graph_too_large_for_the_zoo_is_refused_before_anything_of_its_size_is_built(
    monkeypatch, graph, expected
):
    # before: zoo=tiny-100000 built 100,000 agent specs first (22-39 s, 1.1 GB), and graph=complete
    # then tried to build 5e9 edges (no answer). Nothing of the zoo's size may be built now.
    import networkx as nx

    from flwr_sheaf.models import zoo

    def built(*a, **k):
        raise AssertionError("something of the zoo's size was built before the refusal")

    monkeypatch.setattr(zoo, "_tiny_spec", built)
    monkeypatch.setattr(nx, "complete_graph", built)
    with pytest.raises(ConfigError) as err:
        parse_run_config({"zoo": "tiny-100000", "graph": graph})
    msg = str(err.value)
    assert msg.startswith(f"graph={graph!r} on zoo='tiny-100000': ") and expected in msg
    assert "graph='class-overlap-knn:4'" in msg and "graph='ring'" in msg


def test_complete_stays_allowed_up_to_its_cap():
    from flwr_sheaf.topology import COMPLETE_MAX_NODES, build_graph, check_graph_scale

    check_graph_scale("complete", COMPLETE_MAX_NODES)
    assert build_graph("complete", 40).number_of_edges() == 40 * 39 // 2
    with pytest.raises(ValueError, match="more than 499500 .* refused"):
        check_graph_scale("complete", COMPLETE_MAX_NODES + 1)


def _no_zoo_sized_build(monkeypatch) -> None:
    """Fail the test if an agent spec or a graph is built (the refusal must come from N alone)."""
    from flwr_sheaf import topology
    from flwr_sheaf.models import zoo

    def built(*a, **k):
        raise AssertionError("something of the zoo's size was built before the refusal")

    monkeypatch.setattr(zoo, "_tiny_spec", built)
    for name in ("class_overlap_knn_graph", "random_regular_graph", "ring_graph", "complete_graph"):
        monkeypatch.setattr(topology, name, built)


@pytest.mark.parametrize(
    "cfg",
    [
        {"zoo": "tiny-100000", "graph": "class-overlap-knn:4"},
        {"zoo": "tiny-100000", "graph": "class-overlap-knn:4", "dataset": "fashion-mnist"},
        {"zoo": "tiny-10000000", "graph": "class-overlap-knn:4"},
        {"zoo": "tiny-10000000", "graph": "random-regular:4", "dataset": "fashion-mnist"},
        {"zoo": "tiny-10000000", "graph": "ring", "partitioner": "cross-device"},
    ],
)
def test_an_infeasible_scale_is_refused_from_the_config_alone_in_well_under_a_second(
    monkeypatch, cfg
):
    # issue 34 case 4, before: tiny-100000 + class-overlap-knn:4 passed the config check after
    # building 100,000 specs and the graph (9-27 s) and was refused only by the data split; tiny-10^7
    # built 10^7 specs and the graph (minutes, GBs) first. Now: from N and the dataset's size alone.
    import time
    import tracemalloc

    parse_run_config({"zoo": "tiny-3", "graph": "ring"})  # imports out of the measurement
    _no_zoo_sized_build(monkeypatch)
    tracemalloc.start()
    t = time.perf_counter()
    try:
        with pytest.raises(ConfigError) as err:
            parse_run_config(cfg)
        wall = time.perf_counter() - t
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(err.value)
    assert wall < 1.5 and peak < 5e6, (wall, peak)
    assert msg.startswith(f"zoo={cfg['zoo']!r}") and (
        "use a smaller zoo" in msg or "use at most zoo='tiny-" in msg  # memory: a number that fits
    ), msg


def test_the_dataset_bound_counts_the_partitioners_fewest_samples_past_the_pilot_hold_out():
    from flwr_sheaf.data.partition import check_agents_fit

    # fashion-mnist: 70,000 images, 7,000 held out for pilots; label-shift needs 5 samples an agent
    # (a class chunk of < 5 gives no validation sample), cross-device 3, dirichlet 10
    for part, most in (("label-shift", 12600), ("cross-device", 21000), ("dirichlet:0.5", 6300)):
        check_agents_fit("fashion-mnist", most, partitioner=part)
        with pytest.raises(ValueError, match=rf"at most {most} agents could fit"):
            check_agents_fit("fashion-mnist", most + 1, zoo=f"tiny-{most + 1}", partitioner=part)
    # mnist-bundled: 5,000 images, 500 pilots (its default num-pilots=500 fits, 501 does not)
    check_agents_fit("mnist-bundled", 900, 500)
    with pytest.raises(ValueError, match=r"num-pilots=501 exceeds the 500 samples"):
        check_agents_fit("mnist-bundled", 15, 501)
    check_agents_fit("hf:some/dataset", 10**9)  # size unknown without loading it: the nodes check


def test_the_dataset_bound_advises_no_refused_zoo_and_not_the_dataset_in_use():
    # attack F11: on fashion-mnist, tiny-100000 was told "use at most zoo='tiny-21000' ... or a larger
    # dataset (e.g. dataset='fashion-mnist')", and tiny-21000 was then refused by the split
    msg = ""
    with pytest.raises(ConfigError) as err:
        parse_run_config(
            {"zoo": "tiny-100000", "graph": "class-overlap-knn:4", "dataset": "fashion-mnist"}
        )
    msg = str(err.value)
    assert "dataset='fashion-mnist', 70,000" not in msg and "zoo='tiny-" not in msg.split(":", 1)[1]
    assert "at least 5" in msg and "checks the exact split before training" in msg, msg
    # mnist-bundled is told of the larger fashion-mnist
    with pytest.raises(ConfigError, match=r"dataset='fashion-mnist', 70,000 images"):
        parse_run_config({"zoo": "tiny-901", "graph": "ring", "dataset": "mnist-bundled"})


@pytest.mark.parametrize("partitioner, need", [("label-shift", 5), ("cross-device", 3)])
def test_past_the_dataset_bound_the_split_itself_refuses(partitioner, need):
    # the bound is necessary: one agent more than (M - hold-out) / need, and the real split leaves
    # some agent with an empty split (the rule the config check states is the partition's own)
    from flwr_sheaf.data.partition import check_all_agents, prepare_split

    most = (5000 - 500) // need
    parse_run_config(
        {"zoo": f"tiny-{most}", "graph": "ring", "partitioner": partitioner}
    )  # mnist-bundled: passes the config check
    with pytest.raises(ConfigError, match=rf"at least {need}, so at most {most} agents could fit"):
        parse_run_config({"zoo": f"tiny-{most + 1}", "graph": "ring", "partitioner": partitioner})
    sets = [list(range(10))] * (most + 1)
    prepared = prepare_split("mnist-bundled", sets, 0.0, 0, None, partitioner)
    with pytest.raises(ValueError, match=r"agents get an empty training, validation or test split"):
        check_all_agents(prepared)


def test_an_idx_directory_size_is_read_from_its_label_headers(tmp_path):
    import gzip
    import struct

    from flwr_sheaf.data.partition import check_agents_fit
    from flwr_sheaf.data.sources import source_size

    # 3,000 + 1,000 labels (one file gzipped): 4,000 samples, 400 pilots, (4000 - 400) / 5 = 720
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(
        struct.pack(">II", 0x801, 3000) + bytes(3000)
    )
    with gzip.open(tmp_path / "t10k-labels-idx1-ubyte.gz", "wb") as fh:
        fh.write(struct.pack(">II", 0x801, 1000) + bytes(1000))
    assert source_size(f"idx:{tmp_path}") == 4000
    check_agents_fit(f"idx:{tmp_path}", 720)
    with pytest.raises(ValueError, match=r"at most 720 agents could fit"):
        check_agents_fit(f"idx:{tmp_path}", 721)
    assert source_size(f"idx:{tmp_path / 'missing'}") is None  # loading it names the problem


def test_the_memory_estimate_names_the_largest_zoo_that_fits():
    from flwr_sheaf.config import check_run_memory

    # 8 GiB: (8 - 1.2) GiB / 52 KiB = 6.8 * 2^20 / 52 = 137,121.5 agents
    check_run_memory("tiny-137121", 137121, memory=8 * 2**30)
    with pytest.raises(ConfigError):
        check_run_memory("tiny-137122", 137122, memory=8 * 2**30)
    with pytest.raises(ConfigError, match=r"^zoo='tiny-200000': .* use at most zoo='tiny-137121'"):
        check_run_memory("tiny-200000", 200000, memory=8 * 2**30)


def test_the_documented_ten_thousand_agent_run_passes_the_scale_check():
    import time

    # benchmarks/records/performance.md, "The scale curve": 10,000 agents, fashion-mnist, cross-device split
    big = {
        "zoo": "tiny-10000",
        "dataset": "fashion-mnist",
        "partitioner": "cross-device",
        "graph": "class-overlap-knn:4",
    }
    from flwr_sheaf.config import RunConfig

    t = time.perf_counter()
    RunConfig.from_run_config(big).check_scale()  # no error
    assert time.perf_counter() - t < 1.5


# ------------------------------------------------------------------- case 8: RFedAGS's run config

TEN = ",".join(["0.5"] * 10)  # one probability per node of the planted problems (N = 10)


def test_rfedags_takes_a_participation_list_of_its_problems_node_count():
    from flwr_sheaf.apps.methods import num_nodes

    # before: 10 values were refused "on zoo='paper-15' ... expected 15" (the CNN zoo's count)
    cfg, method = parse_run_config({"method": "rfedags", "participation": TEN})
    n = num_nodes(cfg, method)
    assert n == cfg.agents == 10
    strategy = method.strategy(cfg, n)
    assert strategy.results_extra()["participation"]["mode"] == "bernoulli"
    # before: 15 values passed the config check and were refused later by the strategy
    with pytest.raises(ConfigError) as err:
        parse_run_config({"method": "rfedavg", "participation": ",".join(["0.5"] * 15)})
    assert str(err.value).startswith("participation='0.5,") and (
        "on method='rfedavg' (10 agents): participation spec" in str(err.value)
    )
    assert str(err.value).endswith("has 15 values, expected 10")


def test_rfedags_minibatch_on_a_problem_without_samples_is_refused_before_any_message():
    from flwr_sheaf.apps.methods import build_strategy

    cfg, _ = parse_run_config({"method": "rfedags", "rfedags-minibatch-size": 8})
    with pytest.raises(ConfigError) as err:  # before: every node failed every round
        build_strategy(cfg)
    assert str(err.value) == (
        "rfedags-minibatch-size=8: rfedags-problem='pca' has no per-client samples, only exact "
        "gradients; use rfedags-minibatch-size=0, or a problem with samples ('spd', 'poincare')"
    )
    spd = {"method": "rfedags", "rfedags-problem": "spd"}
    build_strategy(parse_run_config({**spd, "rfedags-minibatch-size": 3})[0])  # S = 3: allowed
    with pytest.raises(ConfigError, match="has S=3 samples per client; use 1..3"):
        build_strategy(parse_run_config({**spd, "rfedags-minibatch-size": 4})[0])


def test_inprocess_script_runs_rfedags_and_prints_its_gap(tmp_path):
    out = tmp_path / "res"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "simulations" / "inprocess.py"),
            "method=rfedags",
            "num-server-rounds=2",
            f"participation='{TEN}'",
            f"results-dir={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]  # before: IndexError after a valid run
    printed = json.loads(proc.stdout[proc.stdout.index("{") :])
    res = json.loads((out / "results.json").read_text())
    assert (
        printed == {k: res["rounds"][-1][k] for k in ("round", "gap", "distance_to_optimum")}
        and printed["round"] == 2
    )


# ---------------------------------------------------------------- issue 34: config and scale (case 10)


def test_a_zoo_of_one_agent_is_refused_up_front_by_its_key():
    """Issue 34 case 10: ``zoo=tiny-1`` was accepted and failed later ("pilot matrix shape None")."""
    from flwr_sheaf.config import RunConfig

    with pytest.raises(
        ConfigError, match=r"zoo='tiny-1': a zoo of 1 agent .* at least 2 agents.*tiny-2"
    ):
        RunConfig.from_run_config({"zoo": "tiny-1"})
    assert RunConfig.from_run_config({"zoo": "tiny-2", "graph": "ring"}).scenario.zoo == "tiny-2"


@pytest.mark.parametrize("n", [0, 1])
def test_a_zoo_of_fewer_than_two_agents_advises_n_at_least_two(n):
    """Issue 34, F1: ``zoo='tiny-0'`` said "needs N >= 1", but tiny-1 is refused too."""
    from flwr_sheaf.config import RunConfig

    with pytest.raises(ConfigError) as e:
        RunConfig.from_run_config({"zoo": f"tiny-{n}"})
    msg = str(e.value)
    assert msg.startswith(f"zoo='tiny-{n}': a zoo of {n} agent") and "N >= 2" in msg, msg
    assert "N >= 1" not in msg


@pytest.mark.parametrize("value", ["abc", "1.5", True, -1, "", "7"])
def test_a_node_partition_id_that_is_not_a_valid_integer_is_named(value):
    """Issue 34 case 10: a node config ``partition-id`` that is not an integer gave a bare
    ``invalid literal for int()``; now the key, the value, the node and the fix are named."""
    from flwr.app import Context, RecordDict

    from flwr_sheaf.config import node_partition_id

    ctx = Context(
        run_id=1,
        node_id=42,
        node_config={"partition-id": value, "num-partitions": 5},
        state=RecordDict(),
        run_config={},
    )
    with pytest.raises(ConfigError, match=r"node 42: node config partition-id=.*--node-config"):
        node_partition_id(ctx)


def test_a_node_partition_id_given_as_digits_is_read():
    from flwr.app import Context, RecordDict

    from flwr_sheaf.apps.scenario import node_partition_id

    for raw, want in ((3, 3), ("4", 4), (" 0 ", 0)):
        ctx = Context(1, 2, {"partition-id": raw, "num-partitions": 5}, RecordDict(), {})
        assert node_partition_id(ctx) == want


@pytest.mark.parametrize("method", ["rfedags", "rfedproj"])
def test_a_bad_partition_id_gets_the_same_message_on_an_rfedags_node(method):
    """Issue 34 case 10, a non-CNN path: RFedAGS's query handler read ``int(partition-id)`` itself
    (``invalid literal for int() with base 10: 'abc'``); every reader now goes through
    :func:`flwr_sheaf.config.node_partition_id`, so the node's error reply names the key and the fix."""
    from flwr.app import RecordDict

    from flwr_sheaf.apps.client_app import app
    from flwr_sheaf.testing import LocalGrid

    grid = LocalGrid(
        app,
        3,
        run_config={"method": method},
        node_config=lambda i: {"partition-id": "abc"} if i == 1 else {},
    )
    msgs = [grid.create_message(RecordDict(), "query.rfedags", nid, "0") for nid in grid.node_ids]
    replies = list(grid.send_and_receive(msgs))
    by_node = {r.metadata.src_node_id: r for r in replies}
    bad = by_node[grid.node_ids[1]]
    assert bad.has_error(), bad
    reason = bad.error.reason  # repr of the exception: its quotes escaped
    assert reason.startswith(f"ConfigError('node {grid.node_ids[1]}: node config partition-id="), (
        reason
    )
    assert "abc" in reason and "int()" not in reason
    assert 'is not an integer; start the SuperNode with --node-config "partition-id=<i>' in reason
    assert not by_node[grid.node_ids[0]].has_error(), by_node[grid.node_ids[0]].error


def test_num_pilots_errors_use_the_run_config_key():
    """Issue 34 case 10: the num-pilots errors named ``num_pilots`` / ``pilot_fraction``."""
    import numpy as np

    from flwr_sheaf.data.partition import make_dirichlet_split, make_federated_split

    labels = np.repeat(np.arange(10), 20)  # 200 samples: a hold-out of 20
    with pytest.raises(
        ValueError, match=r"^num-pilots=10000: must be an integer in \[1, 20\]"
    ) as e:
        make_dirichlet_split(labels, 4, alpha=1.0, seed=0, num_pilots=10000)
    sets = [tuple(range(10))] * 4
    with pytest.raises(
        ValueError, match=r"^num-pilots=10000 exceeds the 20 eligible.*num-pilots <= 20"
    ) as f:
        make_federated_split(labels, sets, shift=0.0, seed=0, num_pilots=10000)
    for err in (e, f):
        assert "num_pilots" not in str(err.value) and "pilot_fraction" not in str(err.value)
        assert "num-pilots=0" in str(err.value)


def test_scale_benchmark_refuses_bad_agent_counts_by_flag():
    """Issue 34 case 10: ``benchmarks/scale.py --agents`` bad values were tracebacks."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"
    for bad, why in (("abc", "not a whole number"), ("10,,20", "entry 1"), ("1", "too few")):
        proc = subprocess.run(
            [sys.executable, str(script), "--agents", bad],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert f"argument --agents: {bad!r}" in proc.stderr and why in proc.stderr


@pytest.mark.parametrize("partitioner", ["label-shift", "cross-device"])
def test_a_zoo_the_split_refuses_is_told_the_largest_tiny_zoo_that_passes(partitioner):
    # attack F11 (b): the advice used to be a size the split then refused. Now the split's refusal
    # names the largest tiny zoo it serves; that zoo passes the config check and the split's own
    # check, and one agent more is refused (mnist-bundled, 5,000 images: fast)
    import re

    from flwr_sheaf.apps.scenario import check_scenario
    from flwr_sheaf.config import ScenarioConfig, apply_preset

    def scenario(n: int) -> ScenarioConfig:
        cfg = {"zoo": f"tiny-{n}", "dataset": "mnist-bundled", "partitioner": partitioner}
        parse_run_config({**cfg, "graph": "ring"})  # the config check passes
        return ScenarioConfig.from_mapping(apply_preset(cfg))

    with pytest.raises(ConfigError) as err:
        check_scenario(scenario(900))
    found = re.search(r"zoo='tiny-(\d+)' is the largest tiny zoo this split serves", str(err.value))
    assert found is not None, str(err.value)
    best = int(found.group(1))
    assert 2 <= best < 900
    check_scenario(scenario(best))  # the advised zoo passes the split's own check
    with pytest.raises(ConfigError, match="agents get an empty|target classes without"):
        check_scenario(scenario(best + 1))
