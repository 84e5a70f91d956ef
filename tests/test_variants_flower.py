"""Homogeneous (Alg. 2) and stringent-privacy (Alg. 3/4) Sheaf-FRL through the in-process grid (notes/variants-privacy.md)."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch

from flwr_sheaf.apps.client_app import app as cnn_client_app
from flwr_sheaf.apps.scenario import cnn_task_factory
from flwr_sheaf.client.common import build, eval_latents
from flwr_sheaf.config import FederationConfig, LocalTrainConfig
from flwr_sheaf.methods.sheaf_frl.config import SheafConfig
from flwr_sheaf.methods.sheaf_frl.strategy import SheafFRL
from flwr_sheaf.rundir import Checkpointer, load_checkpoint
from flwr_sheaf.sheaf import init_map, orient_edge, procrustes
from flwr_sheaf.testing import LocalGrid

torch.set_num_threads(1)

RC = {"zoo": "tiny-4", "num-pilots": 24, "seed": 3}
TRAIN = LocalTrainConfig(local_epochs=1, max_steps_per_epoch=2, batch_size=16)


def _strategy(n=4, graph="ring", fraction=1.0, evaluate_every=1, **sheaf):
    fed = FederationConfig(
        graph=graph,
        seed=RC["seed"],
        fraction_train=fraction,
        evaluate_every=evaluate_every,
        evaluate_nodes="drawn",  # every node evaluated, as these relay tests read it
    )
    return SheafFRL(
        num_nodes=n,
        federation=fed,
        train=TRAIN,
        sheaf=SheafConfig(lam=0.5, pilot_batch_size=16, **sheaf),
    )


class Recorder:
    """Wraps the ClientApp; after every handler call keeps the node's raw and whitened pilots
    (rebuilt from its committed state), so a test can compare them with what the node sent."""

    def __init__(self, app):
        self.app, self.pilots, self.at_reply = app, [], {}

    def __call__(self, msg, ctx):
        reply = self.app(msg, ctx)
        mt, pid = msg.metadata.message_type, int(ctx.node_config["partition-id"])
        if mt.startswith("train.") and "sheaf.pilots" in ctx.state:
            task, model, _ = build(cnn_task_factory, ctx, "sheaf", 1, device_spec="cpu")
            raw = eval_latents(model, task.x_pilot).double().numpy()
            white = ctx.state["sheaf.pilots"]["pilots"].numpy().astype(np.float64)
            self.pilots.append((pid, raw, white))
        if mt.startswith(("train.", "evaluate.")) and not mt.endswith("_comm"):
            # the node's pilots when it sent this reply (evaluation: unchanged since its last training)
            self.at_reply[id(reply)] = [(r, w) for p, r, w in self.pilots if p == pid][-1]
        return reply


def _arrays(content):
    return [
        (name, key, rec[key].numpy())
        for name, rec in content.array_records.items()
        for key in rec.keys()
    ]


def _recovers(x, a, holdings, width, src):
    """Whether an attacker holding ``holdings`` recovers ``a (K, width)`` of node ``src`` from message ``x`` to 5 %."""
    x = torch.from_numpy(np.asarray(x, dtype=np.float64))
    a = torch.from_numpy(a)
    cands = [x[:, :width]]  # the message read as if the map were a truncated identity
    for h in holdings:  # align the message onto anything the receiver holds (Procrustes)
        h = torch.from_numpy(np.asarray(h, dtype=np.float64))
        if h.shape[0] == x.shape[0] and h.shape[1] <= x.shape[1] and h.shape[1] == width:
            cands.append(x @ procrustes(x, h))
    for s in (0, 1):  # a public-key guess of the initial map (seed, partition-ids, secret 0/1)
        for j in range(4):
            if x.shape[1] >= width:
                cands.append(x @ init_map(x.shape[1], width, (RC["seed"], src, j, s)))
    return any(float(torch.linalg.norm(c - a) / torch.linalg.norm(a)) < 0.05 for c in cands)


def test_stringent_no_pilot_matrix_leaves_a_node_and_bytes_follow_tab1():
    rec = Recorder(cnn_client_app)
    grid = LocalGrid(rec, 4, run_config=RC)
    s = _strategy(privacy="stringent", evaluate_every=2)
    s.start(grid=grid, num_rounds=2)
    assert not s.bank and not s.ledger.failures
    d = {p: s.nodes[p].d for p in range(4)}
    assert len(set(d.values())) > 1  # heterogeneous: some d_e > d_i
    # (a) nothing a node sends is (a fixed or receiver-computable transform of) its pilot matrices
    held = {}  # what each node has received so far (its holdings)
    checked = 0
    for m in grid.delivered:
        held.setdefault(grid.partition_of(m.metadata.dst_node_id), []).extend(
            x for _, _, x in _arrays(m.content)
        )
    k = RC["num-pilots"]
    for p, _raw, white in rec.pilots:  # a receiver also holds its own pilot matrices
        held.setdefault(p, []).append(white)
    for r in grid.replies:
        src = grid.partition_of(r.metadata.src_node_id)
        mine = rec.at_reply.get(id(r))
        others = [
            h
            for p in range(4)
            if p != src
            for h in held.get(p, [])
            if h.ndim == 2 and h.shape[0] == k
        ]
        others = list({h.tobytes(): h for h in others}.values())
        for _, _, x in _arrays(r.content):
            if x.ndim != 2 or x.shape[0] != k:
                continue  # labels / test latents are not pilot matrices
            for a in mine:  # raw and whitened pilots at the time of this reply
                assert not _recovers(x, a, others, a.shape[1], src)
                checked += 1
    assert checked > 20
    # (c) Tab. 1: toward N(i)^+ (heads) the payload has width d_j, toward N(i)^- width d_i; no raw pilots
    f4 = 4
    ring = nx.cycle_graph(4)
    heads = sum(
        k * d[j] * f4
        for i in range(4)
        for j in ring.neighbors(i)
        if orient_edge(i, d[i], j, d[j])[0] == j
    )
    tails = sum(
        k * d[i] * f4
        for i in range(4)
        for j in ring.neighbors(i)
        if orient_edge(i, d[i], j, d[j])[0] == i
    )
    for h in s.history:
        assert (
            h["pilot_bytes_raw_up"],
            h["pilot_bytes_to_heads_up"],
            h["pilot_bytes_to_tails_up"],
        ) == (0, heads, tails)
    sent = sum(
        x.nbytes
        for r in grid.replies
        if r.metadata.message_type == "train.sheaf"
        for name, _, x in _arrays(r.content)
        if name == "transported"
    )
    assert sent == 2 * (heads + tails)
    assert (
        s.history[-1]["svds_total"] == 2 * ring.number_of_edges()
    )  # P2c + P2d: one per node per edge
    assert 0.0 <= s.history[-1]["communication_accuracy_degree_weighted"] <= 1.0
    assert s.results_extra()["sheaf"]["privacy"] == "stringent"


def test_homogeneous_halves_the_svds_and_relays_transported_pilots():
    rc = {"zoo": "two-agent:8", "num-pilots": 32, "seed": 1}
    out = {}
    for variant in ("heterogeneous", "auto"):
        grid = LocalGrid(cnn_client_app, 2, run_config=rc)
        s = _strategy(n=2, graph="0-1", sheaf_variant=variant)
        s.start(grid=grid, num_rounds=2)
        assert not s.ledger.failures
        out[variant] = (s, grid)
    het, hom = out["heterogeneous"][0], out["auto"][0]
    assert (het.variant, hom.variant) == ("heterogeneous", "homogeneous")
    assert [h["svds_total"] for h in het.history] == [0, 2]
    assert [h["svds_total"] for h in hom.history] == [0, 1]
    # the tail (partition-id 0: tie -> the larger id is head) uploads O A_0 for the head, the head its raw A_1
    grid = out["auto"][1]
    r2 = [
        r
        for r in grid.replies
        if r.metadata.message_type == "train.sheaf" and r.metadata.group_id == "2"
    ]
    kinds = {grid.partition_of(r.metadata.src_node_id): sorted(r.content.array_records) for r in r2}
    assert kinds == {0: ["transported"], 1: ["pilots"]}


def test_homogeneous_with_unequal_dims_is_a_named_error():
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    s = _strategy(sheaf_variant="homogeneous")
    with pytest.raises(
        ValueError,
        match=r"sheaf-variant='homogeneous' needs equal stalk dimensions.*\{0: 16, 1: 24",
    ):
        s.discover(grid, timeout=5)


def test_stringent_with_partial_participation_uses_cached_transported_pilots(tmp_path):
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    s = _strategy(fraction=0.5, privacy="stringent", absent_policy="cached")
    s.start(grid=grid, num_rounds=3)
    assert not s.ledger.failures and not s.bank
    assert [h["num_trained"] for h in s.history] == [2, 2, 2]
    assert max(h["relayed_pilot_age_max"] for h in s.history) >= 1
    assert any(h["edges_relayed"] > 0 for h in s.history[1:])
    # every node that trained keeps its maps in context.state (persisted by the state mod)
    trained = {p for h in s.history for p in h["sampled"]}
    for p in trained:
        st = grid.contexts[grid.node_ids[p]].state
        assert "sheaf.maps" in st and "sheaf.privacy-secret" in st
        assert sorted(int(k) for k in st["sheaf.maps"].keys()) == sorted(
            nx.cycle_graph(4).neighbors(p)
        )
    # the strategy's new state is plain attributes: the checkpointer stores it
    assert s.edge_bank and all(a.shape[0] == RC["num-pilots"] for a in s.edge_bank.values())
    path = Checkpointer(tmp_path, {}, every=1).save(s, 3, None, 1.0)
    state = load_checkpoint(path)["state"]
    assert state["variant"] == "heterogeneous" and state["evaluation"].transported is True
    assert (
        set(state["edge_bank"]) == set(s.edge_bank)
        and state["edge_bank_round"] == s.edge_bank_round
    )


def test_homogeneous_with_partial_participation_relays_cached_messages():
    rc = {"zoo": "two-agent:8", "num-pilots": 32, "seed": 1}
    grid = LocalGrid(cnn_client_app, 2, run_config=rc)
    s = _strategy(n=2, graph="0-1", fraction=0.5, evaluate_every=4, sheaf_variant="homogeneous")
    s.start(grid=grid, num_rounds=4)
    assert not s.ledger.failures and s.variant == "homogeneous"
    assert [h["num_trained"] for h in s.history] == [1, 1, 1, 1]
    # each trained node used what the other sent in an earlier round (cached): ages >= 1
    relayed = [h for h in s.history if h["edges_relayed"]]
    assert relayed and all(h["relayed_pilot_age_max"] >= 1 for h in relayed)
    # the tail (0) only ever uploads O A_0 for the head, the head (1) only its raw pilots
    assert set(s.edge_bank) <= {(0, 1)} and set(s.bank) <= {1}
    assert s.history[-1]["communication_accuracy_degree_weighted"] >= 0.0


# ---------------------------------------------------------------- variants x pilot strategies (notes/variants.md)
def _relayed_rows(grid, record):
    """Row counts of every matrix relayed in ``record`` of the train messages, per server round."""
    rows = {}
    for m in grid.delivered:
        if m.metadata.message_type == "train.sheaf" and record in m.content.array_records:
            rec = m.content.array_records[record]
            if not list(rec.keys()):
                continue  # round 1: an empty record (nothing to relay yet)
            rows.setdefault(int(m.metadata.group_id), set()).update(
                rec[k].numpy().shape[0] for k in rec.keys()
            )
    return rows


def test_stringent_with_a_uniform_pilot_subset_and_parseval_reduces_the_transported_matrices():
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    s = _strategy(privacy="stringent", pilot_strategy="uniform:12", pilot_normalisation="parseval")
    s.start(grid=grid, num_rounds=3)
    assert not s.ledger.failures and not s.bank  # digests agreed on every node; no raw pilots held
    assert [h["pilot_rows"] for h in s.history] == [12, 12, 12]
    # uploads keep all M rows (the relay serves any later selection); what is relayed has the K selected rows
    assert all(a.shape[0] == RC["num-pilots"] for a in s.edge_bank.values())
    assert _relayed_rows(grid, "transported") == {2: {12}, 3: {12}}
    assert s.history[-1]["sheaf_diagnostics_skipped"].startswith(
        "SheafFRL does not hold the nodes' raw pilots"
    )


def test_homogeneous_with_class_prototypes_relays_one_row_per_class():
    rc = {"zoo": "two-agent:8", "num-pilots": 32, "seed": 1}
    grid = LocalGrid(cnn_client_app, 2, run_config=rc)
    s = _strategy(n=2, graph="0-1", pilot_strategy="prototype-class")
    s.start(grid=grid, num_rounds=3)
    assert not s.ledger.failures and s.variant == "homogeneous"
    groups = s.pilots.sampler.num_groups
    assert 2 <= groups <= 10 and s.history[-1]["pilot_rows"] == groups
    # the tail's O A_0 and the head's raw A_1, each reduced to one mean per class
    assert (
        _relayed_rows(grid, "transported")
        == {2: {groups}, 3: {groups}}
        == _relayed_rows(grid, "pilots")
    )


def test_adaptive_pilots_need_the_raw_matrices_of_alg1():
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    with pytest.raises(ValueError, match=r"pilot-strategy='adaptive:8'.*privacy='stringent'"):
        _strategy(privacy="stringent", pilot_strategy="adaptive:8").discover(grid, timeout=5)
    rc = {"zoo": "two-agent:8", "num-pilots": 32, "seed": 1}
    s = _strategy(n=2, graph="0-1", pilot_strategy="adaptive:8")
    s.discover(LocalGrid(cnn_client_app, 2, run_config=rc), timeout=5)
    assert s.variant == "heterogeneous"  # `auto` with equal d_i, turned to Alg. 1 by adaptive


@pytest.mark.parametrize("policy", ["drop", "drop-reweighted"])
def test_stringent_with_drop_policies_relays_only_previous_round_transported_pilots(policy):
    grid = LocalGrid(cnn_client_app, 4, run_config=RC)
    s = _strategy(fraction=0.5, privacy="stringent", absent_policy=policy)
    s.start(grid=grid, num_rounds=4)
    assert not s.ledger.failures and not s.bank
    relayed = [h for h in s.history if h["edges_relayed"]]
    assert relayed, "no transported pilots were ever relayed"
    # drop policies relay only what a neighbour produced in the previous round (age 1) ...
    assert all(h["relayed_pilot_age_max"] == 1 for h in relayed)
    # ... per directed edge: each relayed (receiver, sender) pair had its sender trained the round before
    last = s.history[-1]
    trained_before = set(s.history[-2]["sampled"])
    assert {j for (_, j) in s.relayed} <= trained_before
    if policy == "drop-reweighted":
        assert all(w >= 1.0 for _, w in s.relayed.values())  # 1/q_j with q_j <= 1
    else:
        assert all(w == 1.0 for _, w in s.relayed.values())
    assert last["num_trained"] == 2
