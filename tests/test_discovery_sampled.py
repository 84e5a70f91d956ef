"""Sampled discovery (run-config ``discovery = "sampled"``, ``flwr_sheaf.strategy.sampled``), in-process.

- invariance: with every node training and evaluated, a sampled run records exactly the numbers of
  full discovery on the same seed (rounds, per-node and per-edge results), and the graph the ServerApp
  builds from the scenario is the one full discovery builds from the replies (a class-overlap spec);
- only drawn nodes are queried, each at most once: the queried node ids equal the union of the
  draws, recomputed here from numpy's uniforms over the sorted node ids;
- a node whose reply disagrees with the scenario is that partition-id's recorded failure (field
  named), the others train; as in full discovery, an unusable reply without a spare SuperNode and a
  partition-id reported twice fail the run; a spare SuperNode stays idle (the run completes), and
  more unusable replies than spares make the run degraded;
- the same seed twice gives the same numbers;
- bad values and unsupported combinations are refused before any message, the key named.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.scenario import scenario_node_infos
from flwr_sheaf.apps.server_app import run_server
from flwr_sheaf.config import ConfigError, ScenarioConfig
from flwr_sheaf.protocol import INFO, NodeInfo
from flwr_sheaf.testing import LocalGrid

torch.set_num_threads(1)

TIMING = ("time", "wall", "seconds", "_s")


def _rc(tmp_path, name: str, n: int, **kw) -> dict:
    return {
        "zoo": f"tiny-{n}",
        "graph": "class-overlap-knn:2",
        "num-pilots": 32,
        "local-epochs": 1,
        "max-steps-per-epoch": 1,
        "batch-size": 16,
        "method": "sheaf-frl",
        "num-server-rounds": 2,
        "seed": 3,
        "results-dir": str(tmp_path / name),
        "round-timeout": 5.0,
        **kw,
    }


def _run(rc: dict, n: int, wrap=None) -> tuple[dict, LocalGrid]:
    grid = LocalGrid(cnn_client_app, n, run_config=rc)
    if wrap is not None:
        grid.app = wrap(grid, grid.app)
    return json.loads(run_server(grid, rc).read_text()), grid


def _numbers(res: dict) -> dict:
    """What a run measured, without timings."""
    return {
        "rounds": [
            {k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in res["rounds"]
        ],
        "nodes": res["nodes"],
        "edges": res["edges"],
        "graph": res["graph"],
        "failures": res["failures"],
        "status": res["status"],
    }


def test_every_node_sampled_gives_the_numbers_and_graph_of_full_discovery(tmp_path):
    n = 6
    full, _ = _run(_rc(tmp_path, "all", n), n)
    lazy, grid = _run(_rc(tmp_path, "sampled", n, discovery="sampled"), n)
    assert full["status"] == "completed" and full["graph"]["edges"]
    assert _numbers(lazy) == _numbers(full)
    # every node was described once, in round 1, by its train draw
    queries = [m for m in grid.delivered if m.metadata.message_type.startswith("query.")]
    assert len(queries) == n
    assert lazy["discovery"]["rounds"]["1"]["train"] == list(range(n))
    assert "discovery" not in full
    # the same seed again: the same numbers
    again, _ = _run(_rc(tmp_path, "sampled2", n, discovery="sampled"), n)
    assert _numbers(again) == _numbers(lazy)


def test_the_scenarios_infos_are_what_the_nodes_report(tmp_path):
    n = 6
    rc = _rc(tmp_path, "infos", n)
    grid = LocalGrid(cnn_client_app, n, run_config=rc)
    from flwr_sheaf.methods import parse_run_config
    from flwr_sheaf.strategy.discovery import Discovery

    config, _ = parse_run_config(rc)
    reported = Discovery(n, "sheaf", {"torch-threads": 1, "device": "cpu"}, 10.0).run(grid, 5.0)
    expected = scenario_node_infos(config.scenario, n)
    assert {p: node.info for p, node in reported.items()} == expected


def _draw(node_ids: list[int], fraction: float, seed: int, stream: int, rnd: int) -> set[int]:
    """The fraction draw over positions of the sorted node ids, from numpy's uniforms directly."""
    k = max(1, int(len(node_ids) * fraction))
    u = np.random.default_rng([seed, stream, rnd]).random(len(node_ids))
    return {sorted(node_ids)[i] for i in np.argsort(u, kind="stable")[:k]}


def test_only_drawn_nodes_are_queried_and_each_once(tmp_path):
    n, f = 40, 0.1
    rc = _rc(
        tmp_path,
        "few",
        n,
        discovery="sampled",
        partitioner="cross-device",
        graph="class-overlap-knn:4",
        **{"fraction-train": f, "fraction-evaluate": f, "evaluate-every": 2},
        **{"evaluate-nodes": "drawn"},  # the independent evaluators' draw is queried too
    )
    res, grid = _run(rc, n)
    queried = [
        m.metadata.dst_node_id
        for m in grid.delivered
        if m.metadata.message_type.startswith("query.")
    ]
    ids = grid.get_node_ids()
    drawn = (
        _draw(ids, f, 3, 0, 1) | _draw(ids, f, 3, 0, 2) | _draw(ids, f, 3, 1, 2)
    )  # train r1, r2; evaluators r2
    assert len(queried) == len(set(queried))  # never twice
    assert set(queried) == drawn
    assert len(drawn) < n  # the test means something: most nodes were never messaged
    messaged = {m.metadata.dst_node_id for m in grid.delivered}
    assert messaged == drawn
    for r in res["rounds"]:
        want = {grid.partition_of(i) for i in _draw(ids, f, 3, 0, r["round"])}
        assert set(r["sampled"]) == want
    assert res["status"] == "completed"


def _lying(pid: int, **fields):
    """A ClientApp wrapper: partition ``pid`` reports ``fields`` in its query reply."""

    def wrap(grid, real):
        def app(msg, ctx):
            reply = real(msg, ctx)
            if msg.metadata.message_type.startswith("query.") and (
                grid.partition_of(msg.metadata.dst_node_id) == pid
            ):
                info = replace(NodeInfo.from_record(reply.content[INFO]), **fields)
                reply.content[INFO] = info.to_record()
            return reply

        return app

    return wrap


def test_a_node_disagreeing_with_the_scenario_is_its_recorded_failure(tmp_path):
    n = 6
    rc = _rc(tmp_path, "bad", n, discovery="sampled", **{"max-failed-fraction": 0.5})
    res, grid = _run(rc, n, _lying(2, d=999))
    reasons = [f for f in res["failures"] if f["partition-id"] == 2]
    assert reasons and all(
        "partition-id 2" in f["reason"] and "d 999" in f["reason"] for f in reasons
    )
    assert {f["partition-id"] for f in res["failures"]} == {2}
    assert {f["phase"] for f in reasons} == {"train", "evaluate"}
    node2 = grid.node_ids[2]
    assert [m.metadata.message_type for m in grid.delivered if m.metadata.dst_node_id == node2] == [
        "query.sheaf"
    ]  # queried once, sent nothing else
    assert all(r["num_trained"] == n - 1 for r in res["rounds"])
    assert res["status"] == "degraded"
    assert res["discovery"]["failed"][0]["partition_id"] == 2


def test_other_pilots_are_named_too(tmp_path):
    n = 6
    rc = _rc(tmp_path, "pilots", n, discovery="sampled", **{"max-failed-fraction": 0.5})
    res, _ = _run(rc, n, _lying(4, pilot_digest=12345))
    assert res["failures"] and all(
        f["partition-id"] == 4 and "pilot-digest 12345" in f["reason"] for f in res["failures"]
    )


def _broken(pid: int):
    """A ClientApp wrapper: partition ``pid``'s query handler raises."""

    def wrap(grid, real):
        def app(msg, ctx):
            if msg.metadata.message_type.startswith("query.") and (
                grid.partition_of(msg.metadata.dst_node_id) == pid
            ):
                raise RuntimeError("broken node")
            return real(msg, ctx)

        return app

    return wrap


def test_an_error_reply_without_a_spare_fails_the_run_as_full_discovery_does(tmp_path):
    n = 6
    for mode in ("all", "sampled"):
        rc = _rc(tmp_path, f"err_{mode}", n, discovery=mode)
        grid = LocalGrid(cnn_client_app, n, run_config=rc)
        grid.app = _broken(1)(grid, grid.app)
        with pytest.raises(RuntimeError, match="discovery failed on node .*broken node"):
            run_server(grid, rc)
        assert not any(m.metadata.message_type.startswith("train.") for m in grid.delivered)


def test_a_partition_id_reported_twice_fails_the_run_as_full_discovery_does(tmp_path):
    n = 6
    for mode in ("all", "sampled"):
        rc = _rc(tmp_path, f"dup_{mode}", n, discovery=mode)
        with pytest.raises(
            RuntimeError, match=r"partition-id 2 reported by two nodes \(node \d+ the second\)"
        ):
            _run(rc, n, _lying(5, partition_id=2))


def _spare_run(
    tmp_path, name: str, mode: str, wrap=None, spares: int = 1, **kw
) -> tuple[dict, LocalGrid]:
    # 6 agents and `spares` more SuperNodes: the bundled query handler describes partition-id >= 6
    # as a spare (d = 0)
    n = 6
    rc = _rc(tmp_path, name, n, discovery=mode, **{"fraction-train": 1.0, **kw})
    grid = LocalGrid(cnn_client_app, n + spares, run_config=rc)
    if wrap is not None:
        grid.app = wrap(grid, grid.app)
    return json.loads(run_server(grid, rc).read_text()), grid


def test_a_spare_supernode_stays_idle_and_the_run_completes(tmp_path):
    full, _ = _spare_run(tmp_path, "spare_all", "all")
    lazy, grid = _spare_run(tmp_path, "spare_sampled", "sampled")
    assert full["status"] == lazy["status"] == "completed"
    spare = grid.node_ids[6]
    assert lazy["discovery"]["failed"] == []  # the spare described itself as one
    assert lazy["discovery"]["idle_node_ids"] == [spare]  # ... when it was drawn
    # each round draws floor(f N) = 6 slots; the spare's goes to the next node id: 6 agents train
    assert all(r["num_trained"] == len(r["sampled"]) == 6 for r in lazy["rounds"])
    assert [m.metadata.message_type for m in grid.delivered if m.metadata.dst_node_id == spare] == [
        "query.sheaf"
    ]


def _malformed(pid: int):
    """A ClientApp wrapper: partition ``pid`` answers its query with a NodeInfo lacking ``d``."""

    def wrap(grid, real):
        def app(msg, ctx):
            reply = real(msg, ctx)
            if msg.metadata.message_type.startswith("query.") and (
                grid.partition_of(msg.metadata.dst_node_id) == pid
            ):
                del reply.content[INFO]["d"]
            return reply

        return app

    return wrap


def _silent(pid: int):
    """A grid change: partition ``pid`` never answers its query (LocalGrid's ``drop``)."""

    def wrap(grid, real):
        grid.drop = lambda m: (
            m.metadata.message_type.startswith("query.")
            and (grid.partition_of(m.metadata.dst_node_id) == pid)
        )
        return real

    return wrap


@pytest.mark.parametrize(
    "wrap, said",
    [
        (_broken, "broken node"),
        (_malformed, "lacks key 'd'"),
        (_silent, "no reply within the timeout"),
    ],
    ids=["raises", "bad-info", "no-reply"],
)
def test_a_broken_agent_among_spares_degrades_the_run_and_its_slot_is_filled(
    tmp_path, caplog, wrap, said
):
    # issue 34, case 1: 2 spares, agent 1's query handler broken; half the agents drawn per round
    # (seed 3: the draws over the 8 node ids meet agent 1 and one spare, so before the fix the
    # broken agent passed for the other spare and the run ended `completed`)
    import logging

    log = logging.getLogger("flwr_sheaf")
    log.addHandler(caplog.handler)
    try:
        res, grid = _spare_run(
            tmp_path,
            "broken_among_spares",
            "sampled",
            wrap(1),
            spares=2,
            **{"fraction-train": 0.5, "num-server-rounds": 3, "evaluate-every": 0},
        )
    finally:
        log.removeHandler(caplog.handler)
    broken = grid.node_ids[1]
    assert res["status"] == "degraded"  # before: completed, the broken agent taken for a spare
    assert [f["node_id"] for f in res["discovery"]["failed"]] == [broken]  # the premise: drawn
    assert said in res["discovery"]["failed"][0]["reason"]
    problem = next(p for p in res["degradation"]["problems"] if "no usable description" in p)
    assert problem.startswith("sampled discovery: 1 drawn node(s) gave no usable description")
    assert f"node {broken}" in problem and said in problem
    assert "a broken agent, or a spare SuperNode whose query handler fails" in caplog.text
    assert "(idle)" not in caplog.text
    # every round trains floor(0.5 * 6) = 3 agents: the broken node's slot went to the next one
    assert all(r["num_trained"] == len(r["sampled"]) == 3 for r in res["rounds"])
    assert all(1 not in r["sampled"] for r in res["rounds"])
    from flwr_sheaf.report import summary_lines

    assert (
        summary_lines(res)[0].startswith("RUN DEGRADED")
        and "no usable description" in (summary_lines(res)[0])
    )


def _claims_spare(pid: int):
    """A ClientApp wrapper: partition ``pid`` describes itself as a spare (``d = 0``)."""

    def wrap(grid, real):
        def app(msg, ctx):
            reply = real(msg, ctx)
            if msg.metadata.message_type.startswith("query.") and (
                grid.partition_of(msg.metadata.dst_node_id) == pid
            ):
                reply.content[INFO]["d"] = 0
            return reply

        return app

    return wrap


D0 = r"partition-id 1 reports d 0, the description of a spare SuperNode, but the scenario has 6 agents"


@pytest.mark.parametrize(
    ("wrap", "said"), [(_broken, r"RuntimeError\('broken node'\)"), (_claims_spare, D0)]
)
def test_full_discovery_fails_at_once_naming_a_broken_agent_among_spares(tmp_path, wrap, said):
    # issue 34, F8/F9: 6 agents + 2 spares, discovery=all, agent 1's query handler raises (F8) or
    # describes it as a spare, d = 0 (F9). All 8 SuperNodes answer (7 descriptions + 1 failure), so
    # nothing more can come: before, F8 waited the whole discovery-timeout and advised
    # num-supernodes=6; F9 accepted d = 0 and the run failed blaming agent 1's neighbours
    import time

    timeout = 60.0
    rc = _rc(tmp_path, "all_broken", 6, discovery="all", **{"discovery-timeout": timeout})
    grid = LocalGrid(cnn_client_app, 8, run_config=rc)
    grid.app = wrap(1)(grid, grid.app)
    broken = next(n for n in grid.node_ids if grid.partition_of(n) == 1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        run_server(grid, rc)
    elapsed = time.monotonic() - t0
    assert elapsed < timeout / 4, elapsed  # before (F8): >= 60 s
    assert re.search(
        r"no SuperNode described partition-id\(s\) \[1\] of the 6 agents, and all 8 registered "
        r"SuperNodes answered \(7 described themselves, 1 failed\), so the missing agent\(s\) are "
        rf"among the failed node\(s\): node {broken}: {said}",
        str(err.value),
    ), str(err.value)
    assert "num-supernodes" not in str(err.value)
    assert not any(m.metadata.message_type.startswith("train.") for m in grid.delivered)


def test_a_d0_reply_of_an_agent_without_spares_fails_discovery_naming_it(tmp_path):
    # F9 without spares: the d = 0 reply is node 1's failure at discovery (before: accepted, and its
    # neighbours failed in training with "stalk dimensions must be positive")
    rc = _rc(tmp_path, "d0", 6, discovery="all")
    grid = LocalGrid(cnn_client_app, 6, run_config=rc)
    grid.app = _claims_spare(1)(grid, grid.app)
    broken = next(n for n in grid.node_ids if grid.partition_of(n) == 1)
    with pytest.raises(RuntimeError, match=rf"discovery failed on node {broken}: {D0}"):
        run_server(grid, rc)
    assert not any(m.metadata.message_type.startswith("train.") for m in grid.delivered)


def test_a_slot_that_no_node_can_fill_is_said_and_degrades_the_run(tmp_path, caplog):
    # every agent drawn each round (fraction 1), agent 1 and the only spare both broken: 5 of 6
    import logging

    def both(grid, real):
        return _broken(6)(grid, _broken(1)(grid, real))

    log = logging.getLogger("flwr_sheaf")
    log.addHandler(caplog.handler)
    try:
        res, grid = _spare_run(tmp_path, "unfilled", "sampled", both)
    finally:
        log.removeHandler(caplog.handler)
    assert {f["node_id"] for f in res["discovery"]["failed"]} == {
        grid.node_ids[1],
        grid.node_ids[6],
    }
    assert all(r["num_trained"] == len(r["sampled"]) == 5 for r in res["rounds"])
    assert res["status"] == "degraded"
    problems = res["degradation"]["problems"]
    assert any(
        "2 drawn node(s) gave no usable description" in p and "at least 1 agent(s) failed" in p
        for p in problems
    )
    assert any(
        "could not give every slot to an agent" in p
        and "round 1 train: 5 of 6" in p
        and "round 2 train: 5 of 6" in p
        for p in problems
    )
    assert "only 5 of the 6 drawn slots went to agents" in caplog.text


def test_too_few_supernodes_fails_at_once_naming_the_federation_config(tmp_path):
    # 4 SuperNodes for 6 agents: one node's num-partitions says so, without waiting discovery-timeout
    rc = _rc(tmp_path, "few_nodes", 6, discovery="sampled", **{"discovery-timeout": 3600.0})
    grid = LocalGrid(cnn_client_app, 4, run_config=rc)
    with pytest.raises(RuntimeError, match="num-supernodes=6"):
        run_server(grid, rc)
    assert [m.metadata.message_type for m in grid.delivered] == ["query.sheaf"]


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"discovery": "some"}, "discovery"),
        ({"discovery": "sampled", "participation": "0.5"}, "participation"),
        ({"discovery": "sampled", "resume": True}, "resume"),
        ({"discovery": "sampled", "method": "rfedags"}, "task factory"),
        ({"discovery": "sampled", "dataset": "hf:some/dataset"}, "hf:some/dataset"),
    ],
)
def test_bad_values_and_unsupported_combinations_are_refused_before_any_message(
    tmp_path, extra, named
):
    rc = _rc(tmp_path, "refused", 6, **extra)
    grid = LocalGrid(cnn_client_app, 6, run_config=rc)
    with pytest.raises(ConfigError) as err:
        run_server(grid, rc)
    assert "discovery" in str(err.value) and named in str(err.value)
    assert grid.delivered == []


def test_infos_fail_on_a_missing_file(tmp_path):
    scenario = ScenarioConfig.from_mapping(
        {"zoo": "tiny-4", "dataset": f"idx:{tmp_path / 'missing'}"}
    )
    with pytest.raises(ConfigError, match="discovery='all'"):
        scenario_node_infos(scenario, 4)
