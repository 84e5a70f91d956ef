"""A ClientApp with flwr-sheaf handlers travels by reference when pickled (Flower's Ray engine
pickles the ClientApp with every message; benchmarks/records/performance-ray.md, "Where a message's time went")."""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

from flwr_sheaf.apps.client_app import app as bundled_app
from flwr_sheaf.methods.sheaf_frl.client import register_sheaf_handlers
from flwr_sheaf.protocol import CONFIG, DEVICE, QUERY, TORCH_THREADS, message_type

ROOT = Path(__file__).resolve().parents[1]
#: a one-handler Flower app pickles to about 800 B by value; the bundled app was 74 KB by value.
SMALL = 400


def test_bundled_client_app_pickles_as_its_import_path():
    blob = cloudpickle.dumps(bundled_app)
    assert len(blob) < SMALL, f"{len(blob)} B: the ClientApp travels by value"
    assert b"flwr_sheaf.apps.client_app" in blob
    assert cloudpickle.loads(blob) is bundled_app
    assert pickle.loads(pickle.dumps(bundled_app)) is bundled_app
    import ray.cloudpickle  # what Flower's Ray backend uses to submit a message

    assert ray.cloudpickle.loads(ray.cloudpickle.dumps(bundled_app)) is bundled_app


def test_a_researchers_app_built_with_the_handler_helpers_pickles_by_reference(
    tmp_path, monkeypatch
):
    (tmp_path / "my_sheaf_app.py").write_text(
        textwrap.dedent(
            """
            from flwr.clientapp import ClientApp
            from flwr_sheaf.apps.scenario import cnn_task_factory
            from flwr_sheaf.methods.fedproto.client import register_fedproto_handlers
            from flwr_sheaf.methods.sheaf_frl.client import register_sheaf_handlers

            app = ClientApp()

            @app.train()
            def train(msg, context):
                return msg

            register_sheaf_handlers(app, cnn_task_factory)
            register_fedproto_handlers(app, cnn_task_factory)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_sheaf_app

    blob = cloudpickle.dumps(my_sheaf_app.app)
    assert len(blob) < SMALL
    assert cloudpickle.loads(blob) is my_sheaf_app.app
    # a plain Flower ClientApp without flwr-sheaf handlers is left alone (by value, a new object)
    plain = ClientApp()
    my_sheaf_app.plain = plain
    assert cloudpickle.loads(cloudpickle.dumps(plain)) is not plain


def test_an_app_that_is_no_module_global_goes_by_value_with_one_warning(caplog):
    def make():
        app = ClientApp()
        register_sheaf_handlers(app, lambda context: None)
        return app

    app = make()
    with caplog.at_level(logging.WARNING, logger="flwr_sheaf"):
        blob = cloudpickle.dumps(app)
        cloudpickle.dumps(app)
    # by value, as Flower's default: the app with its bound handlers (the handler functions are
    # module-level, so they travel as names: about 1.3 KB, was 74 KB with nested handlers)
    assert len(blob) > SMALL and b"evaluate_comm_handler" in blob
    copy = cloudpickle.loads(blob)
    assert copy is not app and sorted(copy._registered_funcs) == sorted(app._registered_funcs)
    warnings = [r.getMessage() for r in caplog.records if "module-level" in r.getMessage()]
    assert len(warnings) == 1 and "pickles it by value with every message" in warnings[0]


def test_the_pickled_app_works_in_a_fresh_process(tmp_path):
    """The ~100 bytes sent to a fresh process (as to a Ray actor) become a ClientApp that answers
    discovery for every node with the same NodeInfo as this process's app."""
    from flwr_sheaf.config import FederationConfig
    from flwr_sheaf.methods.sheaf_frl.strategy import SheafFRL
    from flwr_sheaf.testing import LocalGrid

    rc = {"zoo": "tiny-4", "num-pilots": 64, "seed": 3}
    (tmp_path / "app.pkl").write_bytes(cloudpickle.dumps(bundled_app))
    script = textwrap.dedent(
        f"""
        import sys, cloudpickle
        assert "flwr_sheaf.apps.client_app" not in sys.modules
        app = cloudpickle.loads(open({str(tmp_path / "app.pkl")!r}, "rb").read())
        from flwr_sheaf.apps import client_app
        assert app is client_app.app
        from flwr_sheaf.config import FederationConfig
        from flwr_sheaf.methods.sheaf_frl.strategy import SheafFRL
        from flwr_sheaf.testing import LocalGrid
        s = SheafFRL(num_nodes=4, federation=FederationConfig(graph="ring"))
        s.discover(LocalGrid(app, 4, run_config={rc!r}), timeout=5)
        print(repr(sorted((p, n.info) for p, n in s.nodes.items())))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    here = SheafFRL(num_nodes=4, federation=FederationConfig(graph="ring"))
    here.discover(LocalGrid(bundled_app, 4, run_config=rc), timeout=5)
    assert out.stdout.strip().splitlines()[-1] == repr(
        sorted((p, n.info) for p, n in here.nodes.items())
    )


@pytest.mark.parametrize("module", ["flwr_sheaf.apps.client_app"])
def test_unpickling_names_a_missing_attribute(module):
    from flwr_sheaf.client.reference import load_global

    with pytest.raises(AttributeError, match="no attribute 'no_such_app'.*same app code"):
        load_global(module, "no_such_app")


def _tasks(*pids):
    from flwr_sheaf.apps.scenario import scenario_task
    from flwr_sheaf.config import ScenarioConfig

    sc = ScenarioConfig.from_mapping({"zoo": "tiny-8", "num-pilots": 64, "seed": 3})
    return [scenario_task(sc, p) for p in pids]


def test_the_pilot_digest_is_hashed_once_per_tensor_and_follows_in_place_changes(monkeypatch):
    from flwr_sheaf.client import common
    from flwr_sheaf.protocol import pilot_digest

    a, b = _tasks(0, 1)
    assert a.x_pilot is b.x_pilot  # the zoo's nodes share one pilot tensor
    calls = []
    monkeypatch.setattr(common, "pilot_digest", lambda x: calls.append(1) or pilot_digest(x))
    x = a.x_pilot.clone()
    d1, d2 = common.shared_pilot_digest(x), common.shared_pilot_digest(x)
    assert d1 == d2 == pilot_digest(x.numpy()) and len(calls) == 1
    x[0, 0, 0, 0] += 1.0  # modified in place: the digest is that of the new values
    assert common.shared_pilot_digest(x) == pilot_digest(x.numpy()) != d1
    assert len(calls) == 2


def test_the_stalk_check_runs_once_per_architecture_and_still_refuses_a_wrong_width(monkeypatch):
    from flwr_sheaf.client import handlers

    monkeypatch.setattr(handlers, "_STALK_CHECKED", set())
    calls = []
    real = handlers.check_stalk_protocol
    monkeypatch.setattr(
        handlers, "check_stalk_protocol", lambda t, p: calls.append(p) or real(t, p)
    )
    zoo = _tasks(*range(8))
    archs = {handlers._architecture(t) for t in zoo}
    for p, t in enumerate(zoo):
        handlers.check_stalk_protocol_once(t, p)
    assert len(calls) == len(archs) < len(zoo)
    bad = _tasks(0)[0]
    bad.model.d = bad.model.d + 3  # the same modules, a wrong declared width: its own key, refused
    with pytest.raises(ValueError, match=r"partition-id 0: model.latent\(\) returned shape"):
        handlers.check_stalk_protocol_once(bad, 0)
    patched = _tasks(1)[0]
    patched.model.latent = lambda x: real_latent(x)[:, :-1]  # a patched method: checked again
    real_latent = type(patched.model).latent.__get__(patched.model)
    with pytest.raises(ValueError, match="partition-id 1"):
        handlers.check_stalk_protocol_once(patched, 1)


def test_a_discovery_query_leaves_the_nodes_context_as_it_found_it():
    """Flower's Ray engine ships each node's ``Context`` (``state`` included) to the ClientApp actor
    and back with every message: the discovery query stores nothing in it, so what travels is what a
    fresh SuperNode's Context holds (run config and node config), not the node's model or pilots
    (benchmarks/records/performance-ray.md, "Against Flower's floor": 2.1 KB, of which 1.8 KB is the run config)."""
    from flwr_sheaf.config import FederationConfig
    from flwr_sheaf.methods.sheaf_frl.strategy import SheafFRL
    from flwr_sheaf.testing import LocalGrid

    rc = {"zoo": "tiny-4", "num-pilots": 64, "seed": 3}
    grid = LocalGrid(bundled_app, 4, run_config=rc)
    strategy = SheafFRL(num_nodes=4, federation=FederationConfig(graph="ring", seed=3))
    strategy.discover(grid, timeout=5)
    assert len(strategy.nodes) == 4  # every node answered its query
    for i, node_id in enumerate(grid.node_ids):
        context = grid.contexts[node_id]
        assert dict(context.state) == {}, f"partition-id {i}: {list(context.state)}"
        assert len(pickle.dumps(context)) == len(pickle.dumps(grid.fresh_context(i)))


def _query_all(app, n: int, rc: dict) -> dict[int, str]:
    """``{partition-id: error reason}`` of the nodes whose discovery query failed."""
    from flwr_sheaf.testing import LocalGrid

    grid = LocalGrid(app, n, run_config=rc)
    msgs = [
        Message(
            RecordDict({CONFIG: ConfigRecord({TORCH_THREADS: 1, DEVICE: "cpu"})}),
            dst_node_id=node,
            message_type=message_type(QUERY, "sheaf"),
        )
        for node in grid.node_ids
    ]
    return {
        int(grid.contexts[r.metadata.src_node_id].node_config["partition-id"]): r.error.reason
        for r in grid.send_and_receive(msgs, timeout=5)
        if r.has_error()
    }


def test_discovery_checks_a_description_hook_of_every_node_against_its_built_task():
    from flwr_sheaf.apps import scenario
    from flwr_sheaf.client.handlers import describe_task
    from flwr_sheaf.client.task import describer_of, with_describer
    from flwr_sheaf.models.zoo import zoo_specs

    rc = {"zoo": "tiny-12", "num-pilots": 32, "seed": 3}
    sc = scenario.ScenarioConfig.from_mapping(rc)
    tasks = [scenario.scenario_task(sc, p) for p in range(12)]
    truth = [describe_task(t, "cnn") for t in tasks]
    pid = lambda c: int(c.node_config["partition-id"])  # noqa: E731

    def truthful(context):
        return truth[pid(context)]

    def lying(context):
        return dataclasses.replace(truth[pid(context)], num_train=1)

    # right about d, wrong about the class set of the nodes after the first of their architecture
    # (tiny-<N> cycles 5): before, trusted, and the run completed on another graph
    def other_classes(context):
        desc = truth[pid(context)]
        return desc if pid(context) < 5 else dataclasses.replace(desc, classes=(9,))

    def node0(context):  # before: trusted; training failed on a pilot matrix of another width
        return truth[0]

    def numpy_ints(context):  # right, in numpy ints: every node failed in Flower's ConfigRecord
        desc = truth[pid(context)]
        return dataclasses.replace(
            desc, d=np.int64(desc.d), classes=tuple(np.int64(c) for c in desc.classes)
        )

    d = [s.d for s in zoo_specs("tiny-12")]
    for hook, why in (
        (truthful, {}),
        (numpy_ints, {}),
        (lying, {p: "num_train" for p in range(12)}),
        (other_classes, {p: "classes" for p in range(5, 12)}),
        (node0, {p: "d" if d[p] != d[0] else "" for p in range(1, 12)}),
    ):
        app = ClientApp()
        factory = with_describer(lambda c: scenario.cnn_task_factory(c), hook)
        register_sheaf_handlers(app, factory)
        assert describer_of(factory) is hook
        failed = _query_all(app, 12, rc)
        assert set(failed) == set(why), hook.__name__
        for p, field in why.items():
            msg = failed[p]
            assert f"partition-id {p}: the task factory's description hook " in msg
            assert f"{hook.__qualname__!r}" in msg
            differ = msg.split("they differ in ")[1].split(")")[0].split(", ")
            assert field in differ if field else differ


def test_a_wrapper_of_a_factory_with_a_hook_does_not_inherit_it():
    # a wrapper that changes one node's task does not inherit the hook through functools.wraps:
    # its nodes are described from their built tasks (review)
    from flwr_sheaf.apps import scenario
    from flwr_sheaf.client.handlers import describe_task
    from flwr_sheaf.client.task import describer_of, with_describer
    from flwr_sheaf.config import FederationConfig
    from flwr_sheaf.methods.sheaf_frl.strategy import SheafFRL
    from flwr_sheaf.testing import LocalGrid

    def factory(context):
        return scenario.cnn_task_factory(context)

    with_describer(factory, lambda c: describe_task(factory(c)))

    @functools.wraps(factory)
    def fewer(context):
        task = factory(context)
        if int(context.node_config["partition-id"]) == 6:
            task = dataclasses.replace(task, x_train=task.x_train[:5], y_train=task.y_train[:5])
        return task

    assert describer_of(fewer) is None and describer_of(factory) is not None
    rc = {"zoo": "tiny-12", "num-pilots": 32, "seed": 3}
    sc = scenario.ScenarioConfig.from_mapping(rc)
    app = ClientApp()
    register_sheaf_handlers(app, fewer)
    grid = LocalGrid(app, 7, run_config=rc)
    strategy = SheafFRL(num_nodes=7, federation=FederationConfig(graph="ring", seed=3))
    strategy.discover(grid, timeout=5)
    sizes = {n.info.partition_id: n.info.num_examples for n in strategy.nodes.values()}
    full = scenario.scenario_task(sc, 6).x_train.shape[0]
    assert sizes[6] == 5 and full > 5 and sizes[1] == scenario.scenario_task(sc, 1).x_train.shape[0]


def test_the_message_cost_benchmark_checks_its_data_before_starting_anything(
    tmp_path, monkeypatch, capsys
):
    """Without Fashion-MNIST the benchmark used to fail after minutes with "run status
    finished:failed; log <path>"; it now says how to install the data, before any process starts."""
    import importlib.util
    import time

    from flwr_sheaf.data import catalog

    empty = tmp_path / "no-data"
    empty.mkdir()
    monkeypatch.setenv("FLWR_SHEAF_DATA", str(empty))
    monkeypatch.setattr(catalog, "data_dirs", lambda name: [empty / name])
    path = ROOT / "benchmarks" / "ray_message_cost.py"
    spec = importlib.util.spec_from_file_location("ray_message_cost", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    started = []
    monkeypatch.setattr(bench, "run_one", lambda *a, **k: started.append(a))
    monkeypatch.setattr(bench, "listening", lambda port: started.append(port))
    t0 = time.monotonic()
    rc = bench.main(["--supernodes", "10", "--keep", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert rc == 2 and started == [] and time.monotonic() - t0 < 5
    assert "--dataset fashion-mnist" in err and "bash scripts/get_data.sh fashion-mnist" in err
    assert str(empty / "fashion-mnist") in err  # where it looked
    assert not (tmp_path / "work").exists()
    # Flower's trivial app alone needs no data
    monkeypatch.setattr(bench, "listening", lambda port: True)  # stop at the port check
    assert bench.main(["--apps", "trivial"]) == 2
    assert "in use" in capsys.readouterr().err


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "ray_message_cost", ROOT / "benchmarks" / "ray_message_cost.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_message_cost_benchmark_prints_every_repeat_and_compares_the_least_app_cpu(
    tmp_path, monkeypatch, capsys
):
    """One 2-5 s repeat round was the whole repeat measurement (bench1: 5.4 vs 2.8 ms/msg for the
    same trivial app); now every repeat is printed and the ratio compares each app's least CPU of
    the message-carrying processes, Ray's background helpers (dashboard, ...) left out for both."""
    bench = _bench()
    monkeypatch.setattr(bench, "data_problem", lambda dataset: None)
    monkeypatch.setattr(bench, "listening", lambda port: False)

    def rnd(sim, actors, dashboard=0.0):
        cpu = {"simulation": sim, "actors": actors, "ray dashboard": dashboard}
        return {"wall_s": 1.0, "cpu_s": sum(cpu.values()), "cpu_by_process": cpu, "processes": {}}

    fake = {  # CPU-seconds over 10 messages
        "trivial": {
            "first": rnd(0.1, 0.1, 0.2),
            "repeats": [rnd(0.05, 0.05), rnd(0.02, 0.02, 0.5)],
        },
        "flwr-sheaf": {"first": rnd(0.2, 0.1), "repeats": [rnd(0.03, 0.03), rnd(0.04, 0.04)]},
    }
    calls = []

    def run_one(app, mode, n, actors, args, work):
        calls.append(args.repeats)
        return {**fake[mode], "total_wall_s": 1.0}

    monkeypatch.setattr(bench, "run_one", run_one)
    assert bench.main(["--supernodes", "10", "--repeats", "2", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert calls == [2, 2]
    assert "each 10.00, 4.00; median 7.00" in out  # trivial, ms per message, without the dashboard
    assert "each 6.00, 8.00; median 7.00" in out
    # repeat: least app CPU 0.06 / 0.04 = 1.50 (medians 0.07 / 0.07 = 1.00); first: 0.3 / 0.2
    assert "(CPU of the app's processes) | 1.50 |   | 1.50 (medians: 1.00)" in out
    # whole tree, the dashboard included: first 0.3 / 0.4; repeat 0.06 / 0.54 (the trivial app's
    # least-app-CPU repeat is the one with the dashboard's 0.5 s spike, kept out of the ratio)
    assert "(whole tree) | 0.75 |   | 0.11 |" in out
    assert "worst CPU ratio (first and repeat rounds, app processes) 1.50" in out


def test_a_worker_importing_another_apps_same_named_package_is_refused_naming_both_files(
    tmp_path, monkeypatch
):
    """A local SuperLink started from another app's folder: its workers import that folder's package
    of the same name. The app that arrives there is not the app being run, even with as many handlers:
    refused, naming both files and the fix; the same bytes at another path (another machine) pass."""
    code = textwrap.dedent(
        """
        from flwr.clientapp import ClientApp
        from flwr_sheaf.methods.sheaf_frl.client import register_sheaf_handlers

        app = ClientApp()
        register_sheaf_handlers(app, lambda context: None)
        """
    )
    run, other, copy = (tmp_path / n / "twinapp" for n in ("run", "other", "copy"))
    for folder, text in ((run, code), (other, code + "# the other app's version\n"), (copy, code)):
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / "client_app.py").write_text(text)

    def fresh_import(root):  # what a worker whose sys.path starts with ``root`` imports
        for name in [m for m in sys.modules if m.split(".")[0] == "twinapp"]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.syspath_prepend(str(root))

    fresh_import(run.parent)
    import twinapp.client_app

    blob = cloudpickle.dumps(twinapp.client_app.app)  # what the run's driver sends
    fresh_import(other.parent)
    with pytest.raises(Exception) as info:
        cloudpickle.loads(blob)
    text = str(info.value)
    assert type(info.value).__name__ == "ClientAppReferenceError"
    assert str(run / "client_app.py") in text and str(other / "client_app.py") in text
    assert text.startswith(
        f"ClientApp twinapp.client_app:app: this worker imported {other / 'client_app.py'}, not this "
        f"run's {run / 'client_app.py'}: another app's package of the same name, in {other.parent}"
    )
    assert "Stop that SuperLink" in text
    fresh_import(copy.parent)
    assert sorted(cloudpickle.loads(blob)._registered_funcs) == sorted(
        twinapp.client_app.app._registered_funcs
    )


def test_a_same_named_package_whose_client_app_is_the_same_but_its_task_differs_is_refused(
    tmp_path, monkeypatch
):
    """Two copies of a template app (``flwr new``, the drop-in): client_app.py unchanged, the model
    and data edited in task.py. A worker importing the other folder's package had been let through
    (the same client_app.py bytes) and trained the other app's model; it is refused like another
    app's package, and a copy with the same files at another path still passes."""
    code = textwrap.dedent(
        """
        from flwr.clientapp import ClientApp
        from flwr_sheaf.methods.sheaf_frl.client import register_sheaf_handlers
        from twintask.task import factory

        app = ClientApp()
        register_sheaf_handlers(app, factory)
        """
    )
    task = "def factory(context):\n    return None\n"
    run, other, copy = (tmp_path / n / "twintask" for n in ("run", "other", "copy"))
    for folder, text in ((run, task), (other, task + "# the other app's model\n"), (copy, task)):
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / "client_app.py").write_text(code)
        (folder / "task.py").write_text(text)

    def fresh_import(root):  # what a worker whose sys.path starts with ``root`` imports
        for name in [m for m in sys.modules if m.split(".")[0] == "twintask"]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.syspath_prepend(str(root))

    fresh_import(run.parent)
    import twintask.client_app

    blob = cloudpickle.dumps(twintask.client_app.app)  # what the run's driver sends
    fresh_import(other.parent)
    with pytest.raises(Exception) as info:
        cloudpickle.loads(blob)
    assert type(info.value).__name__ == "ClientAppReferenceError"
    assert str(info.value).startswith(
        f"ClientApp twintask.client_app:app: this worker imported {other / 'client_app.py'}, not "
        f"this run's {run / 'client_app.py'}: another app's package of the same name"
    )
    fresh_import(copy.parent)
    assert sorted(cloudpickle.loads(blob)._registered_funcs) == sorted(
        twintask.client_app.app._registered_funcs
    )
