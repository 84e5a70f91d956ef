"""CNN encoder / MLP head / agent zoo (paper Tab. 2, Tab. 3; docs/paper.md, s9 and s11 item 9)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from flwr_sheaf.models.cnn import CNNEncoder, MLPHead, SheafAgent
from flwr_sheaf.models.zoo import build_agent, count_parameters, zoo_specs
from flwr_sheaf.paper import PAPER_ZOO_15, AgentSpec, two_agent_bottleneck
from flwr_sheaf.sheaf.whitening import Colouring, Whitening


def _closed_form_params(spec: AgentSpec, num_classes: int = 10) -> int:
    """Conv3x3 (9*in*out + out) + BN2d (2*out) per block; Linear + BN1d per hidden; final Linear."""
    n, prev = 0, 1
    for c in spec.channels:
        n += 9 * prev * c + c + 2 * c
        prev = c
    for h in spec.hidden:
        n += prev * h + h + 2 * h
        prev = h
    return n + prev * num_classes + num_classes


@pytest.fixture(scope="module")
def paper_agents():
    return [build_agent(s, seed=i) for i, s in enumerate(zoo_specs("paper-15"))]


def test_paper_zoo_parameter_counts(paper_agents):
    counts = [count_parameters(a) for a in paper_agents]
    assert sum(counts) == 3_411_690  # paper Tab. 2 ("3.41M"), docs/paper.md, s9
    assert counts[2] == 33_386
    assert counts[11] == 720_890
    assert counts == [_closed_form_params(s) for s in PAPER_ZOO_15]
    for a, s in zip(paper_agents, PAPER_ZOO_15):
        assert a.d == s.d == s.channels[-1] == a.encoder.d == a.head.d
        assert count_parameters(a.encoder.whitening) == 0  # whitening adds buffers only
        assert count_parameters(a.head.colouring) == 0


def test_output_shapes_four_block_paper_agent(paper_agents):
    agent = paper_agents[1]  # 4 conv blocks: 28 -> 14 -> 7 -> 3 -> 1, d = 224
    x = torch.randn(3, 1, 28, 28)
    agent.train()
    assert agent.whitened(x).shape == (3, 224)
    assert agent.private_logits(x).shape == (3, 10)
    agent.eval()
    z = agent.latent(x)
    assert z.shape == (3, 224) and (z >= 0).all()  # post-ReLU average pool
    assert agent.classify_whitened(agent.whitened(x)).shape == (3, 10)


def _tiny_agent(seed: int = 0, index: int = 1) -> SheafAgent:
    return build_agent(zoo_specs("tiny-5")[index], seed=seed)


def test_eval_private_path_equals_whiten_colour_path():
    torch.manual_seed(0)
    agent = _tiny_agent()
    x = torch.randn(40, 1, 28, 28)
    agent.eval()
    with torch.no_grad():
        agent.encoder.whitening.fit(agent.latent(x))
        z = agent.latent(x[:8])
        zhat = agent.whitened(x[:8])
        # whitened pilots: zero mean / identity-ish covariance on the fitting sample
        w_all = agent.whitened(x)
    assert w_all.mean(0).abs().max() < 1e-4
    torch.testing.assert_close(agent.head.colouring(zhat), z, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        agent.classify_whitened(zhat), agent.private_logits(x[:8]), atol=1e-5, rtol=1e-5
    )


def test_state_dict_round_trip_keeps_colour_whiten_identity():
    torch.manual_seed(1)
    src = _tiny_agent(seed=0)
    x = torch.randn(32, 1, 28, 28)
    src.train()
    for _ in range(3):  # train-mode passes update BN and whitening running statistics
        src.whitened(x)
    src.eval()
    keys = list(src.state_dict())
    assert "encoder.whitening.running_cov" in keys
    assert sum("running_cov" in k for k in keys) == 1  # stored once, not duplicated by colouring
    assert not any(k.startswith("head.colouring") for k in keys)

    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst = _tiny_agent(seed=123)
    dst.eval()
    _ = dst.whitened(x[:4])  # populate dst's eval cache before loading
    dst.load_state_dict(torch.load(buf))
    # colouring of the fresh model uses the fresh model's (loaded) whitening
    assert dst.head.colouring.whitening is dst.encoder.whitening
    with torch.no_grad():
        z = dst.latent(x)
        torch.testing.assert_close(
            dst.head.colouring(dst.encoder.whitening(z)), z, atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(dst.whitened(x), src.whitened(x))
        torch.testing.assert_close(dst.private_logits(x), src.private_logits(x))
        # statistics are not the initial (0, I) ones
        assert dst.encoder.whitening.running_mean.abs().max() > 1e-3


def test_deepcopy_keeps_colouring_bound_to_its_own_whitening():
    a = _tiny_agent()
    b = copy.deepcopy(a)
    assert b.head.colouring.whitening is b.encoder.whitening
    assert b.encoder.whitening is not a.encoder.whitening


def test_seeded_build_is_reproducible_and_leaves_global_rng_alone():
    spec = PAPER_ZOO_15[2]
    state = torch.random.get_rng_state()
    a, b, c = build_agent(spec, seed=7), build_agent(spec, seed=7), build_agent(spec, seed=8)
    assert torch.equal(torch.random.get_rng_state(), state)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["encoder.backbone.0.0.weight"], sc["encoder.backbone.0.0.weight"])


def test_tiny_300_is_deterministic_small_and_heterogeneous():
    specs = zoo_specs("tiny-300")
    assert len(specs) == 300 and specs == zoo_specs("tiny-300")
    assert specs[:15] == zoo_specs("tiny-15")  # prefix-stable
    assert {s.d for s in specs} <= {16, 24, 32} and len({s.d for s in specs}) == 3
    assert len({(s.channels, s.hidden) for s in specs}) >= 4
    assert {len(s.hidden) for s in specs} == {0, 1}
    assert all(len(s.classes) in (5, 6) and len(set(s.classes)) == len(s.classes) for s in specs)
    assert set().union(*(s.classes for s in specs)) == set(range(10))
    assert all(_closed_form_params(s) < 20_000 for s in specs)
    # build the distinct architectures (the rest repeat them) and check the counts
    seen = {}
    for s in specs:
        seen.setdefault((s.channels, s.hidden), s)
    for s in seen.values():
        agent = build_agent(s, seed=0)
        assert count_parameters(agent) == _closed_form_params(s) < 20_000
        assert agent.d == s.channels[-1]


def test_tiny_300_full_build_is_fast_enough_and_reproducible():
    specs = zoo_specs("tiny-300")
    agents = [build_agent(s, seed=i) for i, s in enumerate(specs)]
    assert max(count_parameters(a) for a in agents) < 20_000
    again = build_agent(specs[137], seed=137)
    w1, w2 = agents[137].state_dict(), again.state_dict()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_two_agent_zoo_and_errors():
    specs = zoo_specs("two-agent:64")
    assert specs == two_agent_bottleneck(64)
    assert [s.d for s in specs] == [64, 64]
    with pytest.raises(ValueError, match="multiple of 4"):
        zoo_specs("two-agent:10")
    with pytest.raises(ValueError, match="paper-15"):
        zoo_specs("resnet-3")
    with pytest.raises(ValueError, match="N >= 2"):  # one agent has no edge (issue 34, F1)
        zoo_specs("tiny-0")
    with pytest.raises(ValueError, match="N >= 2"):
        zoo_specs("tiny-1")
    with pytest.raises(ValueError, match="num_classes"):
        build_agent(PAPER_ZOO_15[0], num_classes=5)  # class 8 outside [0, 5)


def test_whitening_kwargs_reach_the_layer():
    agent = build_agent(PAPER_ZOO_15[9], seed=0, shrinkage=0.25, eps=1e-2, momentum=0.05)
    w = agent.encoder.whitening
    assert (w.shrinkage, w.eps, w.momentum, w.d) == (0.25, 1e-2, 0.05, 80)


def test_model_input_validation():
    enc = CNNEncoder((8, 16), 0.1)
    with pytest.raises(ValueError, match="in_channels=1"):
        enc.latent(torch.randn(2, 3, 28, 28))
    with pytest.raises(ValueError, match="dropout"):
        CNNEncoder((8,), 1.0)
    with pytest.raises(ValueError, match="channels"):
        CNNEncoder((), 0.1)
    with pytest.raises(ValueError, match="d=16"):
        MLPHead(16, (), 0.1, 10, Colouring(Whitening(8)))
    head = MLPHead(16, (8,), 0.1, 10, Colouring(enc.whitening))
    with pytest.raises(ValueError, match="d=16"):
        head(torch.randn(2, 8))
    other = CNNEncoder((8, 16), 0.1)
    with pytest.raises(ValueError, match="reference encoder.whitening"):
        SheafAgent(other, head)
    # train-mode whitening needs B >= 2
    agent = SheafAgent(enc, head).train()
    with pytest.raises(ValueError, match="B=1"):
        agent.whitened(torch.randn(1, 1, 28, 28))
