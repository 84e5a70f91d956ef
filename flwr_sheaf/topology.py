"""Communication graphs (paper Sec. 6 "Network topology"; docs/paper.md, s8): undirected, simple
``networkx.Graph`` objects on partition ids ``0..N-1`` (orientation: :mod:`flwr_sheaf.sheaf`).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "class_overlap_graph",
    "class_overlap_knn_graph",
    "random_regular_graph",
    "ring_graph",
    "complete_graph",
    "edge_list_graph",
    "build_graph",
    "validate_graph",
    "GRAPH_SPECS",
    "MAX_GRAPH_EDGES",
    "edge_count",
    "check_graph_scale",
]

#: Accepted ``spec`` forms of :func:`build_graph` (used in error messages).
GRAPH_SPECS = (
    "class-overlap",
    "class-overlap:<density in (0,1]>",
    "class-overlap-knn:<k>[:<seed>]",
    "random-regular:<k>[:<seed>]",
    "ring",
    "complete",
    "<edge list, e.g. 0-1,1-2>",
)

_EDGE_LIST_RE = re.compile(r"\s*[0-9]+\s*-\s*[0-9]+\s*(,\s*[0-9]+\s*-\s*[0-9]+\s*)*")
_EDGE_CHARS_RE = re.compile(r"[0-9\s,-]*-[0-9\s,-]*")
_NUMBER_RE = re.compile(r"[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?|\.[0-9]+([eE][-+]?[0-9]+)?")


def _strict_edge_list(spec: str, text: str) -> None:
    """Refuse an edge list with an empty or malformed entry, naming it (``'0-1,,1-2'``, ``'0-1,'``)."""
    for i, token in enumerate(text.split(",")):
        if not token.strip():
            raise ValueError(
                f"graph spec {spec!r}: edge {i} (0-based) of the edge list is empty (two commas in a row "
                f"or a comma at an end); write edges as 'i-j,k-l'"
            )
        if not re.fullmatch(r"\s*[0-9]+\s*-\s*[0-9]+\s*", token):
            raise ValueError(
                f"graph spec {spec!r}: malformed edge {token.strip()!r} (edge {i}); expected 'i-j'"
            )


def _density(spec: str, raw: str) -> float:
    """The density of ``class-overlap:<density>``: a plain decimal number in (0, 1]."""
    if not _NUMBER_RE.fullmatch(raw):
        raise ValueError(f"graph spec {spec!r}: density {raw!r} is not a number")
    density = float(raw)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"graph spec {spec!r}: density {raw!r} must be in (0, 1]")
    return density


def _check_num_nodes(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"number of nodes must be a positive integer, got {n!r}")
    return int(n)


#: Most agents of ``graph="complete"`` (499,500 edges: 0.25 s, ~100 MB in networkx).
COMPLETE_MAX_NODES = 1000
#: Most edges a graph may build (:func:`edge_count`): the complete graph's on ``COMPLETE_MAX_NODES``.
MAX_GRAPH_EDGES = COMPLETE_MAX_NODES * (COMPLETE_MAX_NODES - 1) // 2
#: Most distinct class sets of ``class-overlap-knn`` (its ``S x S`` overlap table: 16.7M int64 at 4096).
KNN_MAX_CLASS_SETS = 4096


def class_overlap_graph(class_sets: Sequence[Iterable[int]], density: float = 0.4) -> nx.Graph:
    """The paper's class-overlap graph: maximum spanning tree + heaviest extra edges.

    With ``w_ij = |C_i ∩ C_j|``: Kruskal's maximum spanning tree (edges in lexicographic ``(i, j)``
    order: the reference's tie-breaking), then the other pairs by descending ``w`` (ties by
    ``(min, max)``) up to ``floor(density * N (N-1) / 2)`` edges (paper: 0.4, docs/paper.md, s8).

    Returns ``nx.Graph`` on ``0..N-1`` with an int ``weight`` attribute ``w_ij`` on every edge.

    Raises:
        ValueError: empty ``class_sets`` or class set (agent named), ``density`` outside (0, 1],
            an edge budget below ``N - 1``, or more than :data:`MAX_GRAPH_EDGES` edges.
    """
    import networkx as nx

    sets = _class_sets(class_sets, lambda c: c)
    if isinstance(density, bool) or not isinstance(density, numbers.Real) or not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    n = len(sets)
    check_graph_scale(f"class-overlap:{density}", n)
    num_pairs = n * (n - 1) // 2
    budget = math.floor(density * num_pairs + 1e-9)  # guard float noise, e.g. 0.4 * 105
    if budget < n - 1:
        raise ValueError(
            f"edge budget floor({density} * {num_pairs}) = {budget} is below N - 1 = {n - 1}; "
            f"a connected graph needs a larger density: for {n} agents use graph='ring' or graph='complete'"
            + (
                f" (or class-overlap:<density> with density >= {(n - 1) / num_pairs:.3g})"
                if num_pairs
                else ""
            )
        )

    full = nx.empty_graph(n)
    for i in range(n):
        for j in range(i + 1, n):
            full.add_edge(i, j, weight=len(sets[i] & sets[j]))

    graph = nx.empty_graph(n)
    graph.add_edges_from(
        nx.maximum_spanning_tree(full, weight="weight", algorithm="kruskal").edges(data=True)
    )
    extra = sorted(
        ((d["weight"], i, j) for i, j, d in full.edges(data=True) if not graph.has_edge(i, j)),
        key=lambda t: (-t[0], min(t[1], t[2]), max(t[1], t[2])),
    )
    for w, i, j in extra[: max(0, budget - graph.number_of_edges())]:
        graph.add_edge(i, j, weight=w)
    return graph


def _class_sets(class_sets: Sequence[Iterable[int]], cast: Callable[[Any], Any]) -> list[set]:
    """The class sets as sets of ``cast(class)``, each checked non-empty (agent named)."""
    if isinstance(class_sets, (str, bytes)) or len(class_sets) == 0:
        raise ValueError(
            f"class_sets must be a non-empty sequence of class sets, got {class_sets!r}"
        )
    sets = [{cast(c) for c in cs} for cs in class_sets]
    for i, members in enumerate(sets):
        if not members:
            raise ValueError(f"class set of agent {i} is empty")
    return sets


def _class_matrix(class_sets: Sequence[Iterable[int]]) -> np.ndarray:
    """``(N, C)`` 0/1 membership matrix of non-empty class sets (C = 1 + largest class id)."""
    sets = _class_sets(class_sets, int)
    for i, members in enumerate(sets):
        if min(members) < 0:
            raise ValueError(f"class set of agent {i} has a negative class id {min(members)}")
    m = np.zeros((len(sets), 1 + max(max(s) for s in sets)), dtype=np.int64)
    for i, members in enumerate(sets):
        m[i, sorted(members)] = 1
    return m


def _check_degree(k: int, n: int, name: str) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"{name}: degree k must be a positive integer, got {k!r}")
    if n > 1 and k > n - 1:
        raise ValueError(f"{name}: degree k={k} exceeds N - 1 = {n - 1}")
    return int(k)


def class_overlap_knn_graph(class_sets: Sequence[Iterable[int]], k: int, seed: int = 0) -> nx.Graph:
    """Sparse class-overlap graph for many agents: each agent links to its ``k`` best-overlapping peers.

    With ``w_ij = |C_i ∩ C_j|``, agent ``i`` takes every agent above the ``k``-th best overlap and
    draws the rest (seeded) at that level; the union is undirected. Each further component is joined
    to node 0's by its best-overlap pair (ties: smallest ``(i, j)``). Cost ``O(N k + S^2 C)`` for
    ``S`` distinct class sets (benchmarks/records/performance.md, "Cross-device").

    Returns a connected ``nx.Graph`` on ``0..N-1`` with int ``weight`` ``w_ij`` on every edge;
    ValueError on empty class sets or a bad ``k`` (named).
    """
    import networkx as nx

    m = _class_matrix(class_sets)
    n = m.shape[0]
    graph = nx.empty_graph(n)
    if n == 1:
        return graph
    k = _check_degree(k, n, "class-overlap-knn")
    distinct, set_id = np.unique(m, axis=0, return_inverse=True)
    set_id = set_id.reshape(-1)
    if distinct.shape[0] > KNN_MAX_CLASS_SETS:
        raise ValueError(
            f"class-overlap-knn: the {n} agents have {distinct.shape[0]} distinct class sets; the "
            f"overlap table of distinct sets is refused above {KNN_MAX_CLASS_SETS} of them "
            f"(it grows as their square). Use graph='random-regular:{k}' or graph='ring'"
        )
    overlap = distinct @ distinct.T  # (S, S), S distinct class sets
    src, dst = _knn_choices(set_id, overlap, k, np.random.default_rng([int(seed), 7]))
    weights = overlap[set_id[src], set_id[dst]]
    graph.add_weighted_edges_from(zip(src.tolist(), dst.tolist(), weights.tolist()))
    for i, j in _component_joins(graph, set_id, overlap):
        graph.add_edge(i, j, weight=int(overlap[set_id[i], set_id[j]]))
    return graph


def _knn_choices(
    set_id: np.ndarray, overlap: np.ndarray, k: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Each agent's ``k`` picks of :func:`class_overlap_knn_graph` as ``(src, dst)`` int64 arrays
    (``N k``), per class-set group; ``set_id (N,)`` indexes the ``(S, S)`` ``overlap``."""
    order = np.argsort(set_id, kind="stable")
    counts = np.bincount(set_id, minlength=overlap.shape[0])
    starts = np.concatenate(([0], np.cumsum(counts)))
    members = [order[starts[s] : starts[s + 1]] for s in range(overlap.shape[0])]  # sorted ids
    src_parts, dst_parts = [], []
    for s, own in enumerate(members):
        if own.size == 0:
            continue
        w = overlap[s]
        levels = np.unique(w)[::-1]  # descending overlap levels
        fixed: list[np.ndarray] = []  # groups taken whole (above the k-th best level)
        taken = 0  # peers taken so far by each agent of the group (the same for all)
        for level in levels:
            groups = np.flatnonzero(w == level)
            sizes = counts[groups]
            size = int(sizes.sum()) - (1 if s in groups else 0)  # the agent itself is no peer
            if taken + size <= k:
                fixed.extend(members[g] for g in groups)
                taken += size
                if taken == k:
                    break
                continue
            r = k - taken  # draws among this level's agents, the agent itself excluded
            offsets = np.concatenate(([0], np.cumsum(sizes)))
            excluded = []
            if s in groups:  # the agent's own position in the level: its group's offset + rank
                at = int(offsets[int(np.flatnonzero(groups == s)[0])])
                excluded.append((at + np.arange(own.size))[:, None])
            picks = _draw_without_replacement(rng, int(offsets[-1]), r, excluded, own.size)
            picks = picks.reshape(-1)
            which = np.searchsorted(offsets, picks, side="right") - 1  # level group of each pick
            peers = np.empty_like(picks)
            for g in np.unique(which):  # the picked agent: its rank within its group
                hit = which == g
                peers[hit] = members[groups[g]][picks[hit] - offsets[g]]
            src_parts.append(np.repeat(own, r))
            dst_parts.append(peers)
            break
        if fixed:
            peers = np.concatenate(fixed)
            a = np.repeat(own, peers.size)
            b = np.tile(peers, own.size)
            keep = a != b
            src_parts.append(a[keep])
            dst_parts.append(b[keep])
    if not src_parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    src, dst = np.concatenate(src_parts), np.concatenate(dst_parts)
    return src.astype(np.int64), dst.astype(np.int64)


def _draw_without_replacement(
    rng: np.random.Generator, size: int, r: int, excluded: list[np.ndarray], rows: int
) -> np.ndarray:
    """``(rows, r)`` indices into ``range(size)``: per row ``r`` distinct uniform draws avoiding that
    row's ``excluded`` values (each ``(rows, 1)``), each mapped past the values already taken."""
    taken = list(excluded)
    out = []
    for _ in range(r):
        x = rng.integers(0, size - len(taken), size=(rows, 1))
        if taken:
            prior = np.sort(np.concatenate(taken, axis=1), axis=1)
            for c in range(prior.shape[1]):
                x = x + (x >= prior[:, c : c + 1])
        taken.append(x)
        out.append(x)
    return np.concatenate(out, axis=1)


def _component_joins(
    graph: nx.Graph, set_id: np.ndarray, overlap: np.ndarray
) -> list[tuple[int, int]]:
    """The edges joining ``graph``'s components (by smallest node) one by one to node 0's: the pair
    of largest overlap, ties by smallest ``(i, j)``, computed on class-set groups."""
    import networkx as nx

    components = sorted((min(c), c) for c in nx.connected_components(graph))
    if len(components) == 1:
        return []
    big = np.iinfo(np.int64).max
    joined_min = np.full(overlap.shape[0], big, dtype=np.int64)  # smallest joined agent per set
    joins = []
    for rank, (_, comp) in enumerate(components):
        ids = np.fromiter(comp, dtype=np.int64, count=len(comp))
        comp_min = np.full(overlap.shape[0], big, dtype=np.int64)
        np.minimum.at(comp_min, set_id[ids], ids)
        if rank:
            sa = np.flatnonzero(joined_min < big)
            sb = np.flatnonzero(comp_min < big)
            block = overlap[np.ix_(sa, sb)]
            best = block.max()
            rows = sa[(block == best).any(axis=1)]
            i = int(joined_min[rows].min())
            cols = sb[overlap[set_id[i], sb] == best]
            joins.append((i, int(comp_min[cols].min())))
        joined_min = np.minimum(joined_min, comp_min)
    return joins


def random_regular_graph(n: int, k: int, seed: int = 0, max_tries: int = 100) -> nx.Graph:
    """Connected random ``k``-regular graph: the first connected ``networkx.random_regular_graph``
    of seeds ``seed * 1_000_003 + a``, ``a = 0, 1, ...``.

    Raises:
        ValueError: ``n * k`` odd, ``k`` outside ``[1, N - 1]``, ``k = 1`` with ``N > 2``, or no
            connected draw within ``max_tries``.
    """
    import networkx as nx

    n = _check_num_nodes(n)
    if n == 1:
        return nx.empty_graph(1)
    k = _check_degree(k, n, "random-regular")
    if (n * k) % 2:
        raise ValueError(f"random-regular: N * k must be even, got N={n}, k={k}")
    if k == 1 and n > 2:
        raise ValueError(
            f"random-regular: k=1 gives a perfect matching, never connected for N={n} > 2"
        )
    for attempt in range(max_tries):
        graph = nx.random_regular_graph(k, n, seed=int(seed) * 1_000_003 + attempt)
        if nx.is_connected(graph):
            out = nx.empty_graph(n)
            out.add_edges_from(sorted(tuple(sorted(e)) for e in graph.edges))
            return out
    raise ValueError(
        f"random-regular: no connected {k}-regular graph on {n} nodes in {max_tries} draws; use k >= 3"
    )


def _degree_and_seed(spec: str, text: str) -> tuple[int, int]:
    parts = text.split(":")[1:]
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"graph spec {spec!r}: expected '<name>:<k>' or '<name>:<k>:<seed>'")
    if not all(re.fullmatch(r"[0-9]+", p.strip()) for p in parts):
        raise ValueError(
            f"graph spec {spec!r}: degree/seed {parts} are not integers (digits only, >= 0)"
        )
    vals = [int(p.strip()) for p in parts]
    return vals[0], (vals[1] if len(vals) == 2 else 0)


def ring_graph(n: int) -> nx.Graph:
    """Cycle ``0-1-...-(n-1)-0`` (a path for ``n < 3``); ValueError unless ``n`` is a positive int."""
    import networkx as nx

    n = _check_num_nodes(n)
    return nx.path_graph(n) if n < 3 else nx.cycle_graph(n)


def complete_graph(n: int) -> nx.Graph:
    """All ``n (n-1) / 2`` pairs connected; ValueError unless ``n`` is a positive integer."""
    import networkx as nx

    return nx.complete_graph(_check_num_nodes(n))


def edge_list_graph(spec: str, n: int) -> nx.Graph:
    """Graph on nodes ``0..n-1`` with the edges of ``spec`` (``"i-j,k-l,..."``, spaces allowed).

    Raises:
        ValueError: a malformed token, a self-loop, a repeated edge, or an endpoint outside ``[0, n)``.
    """
    import networkx as nx

    n = _check_num_nodes(n)
    graph = nx.empty_graph(n)
    for token in str(spec).split(","):
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", token)
        if m is None:
            raise ValueError(f"malformed edge {token!r} in edge list {spec!r}; expected 'i-j'")
        i, j = int(m.group(1)), int(m.group(2))
        if i == j:
            raise ValueError(f"self-loop {token.strip()!r} in edge list {spec!r}")
        for v in (i, j):
            if v >= n:
                raise ValueError(f"node {v} in edge {token.strip()!r} is outside [0, {n})")
        if graph.has_edge(i, j):
            raise ValueError(f"edge {i}-{j} appears twice in edge list {spec!r}")
        graph.add_edge(i, j)
    return graph


def build_graph(
    spec: str, num_nodes: int, class_sets: Sequence[Iterable[int]] | None = None
) -> nx.Graph:
    """Build and validate a connected simple topology on nodes ``0..N-1`` from a run-config ``spec``
    (:data:`GRAPH_SPECS`; the class-overlap forms need the ``N`` agents' ``class_sets``).

    Raises:
        ValueError: unknown spec (valid forms listed), missing/mis-sized ``class_sets``, bad
            parameters, or a graph that fails :func:`validate_graph`.
    """
    n = _check_num_nodes(num_nodes)
    text = str(spec).strip()
    check_graph_scale(text, n)  # before anything is built
    if text == "class-overlap" or text.startswith(("class-overlap:", "class-overlap-knn:")):
        if class_sets is None:
            raise ValueError(f"graph spec {spec!r} needs the agents' class_sets")
        if len(class_sets) != n:
            raise ValueError(f"graph spec {spec!r}: {len(class_sets)} class sets for {n} nodes")
    form, params = _parse_graph_spec(spec)
    if form == "class-overlap-knn":
        graph = class_overlap_knn_graph(class_sets if class_sets is not None else (), *params)
    elif form == "random-regular":
        graph = random_regular_graph(n, *params)
    elif form == "class-overlap":
        graph = class_overlap_graph(class_sets if class_sets is not None else (), *params)
    elif form == "ring":
        graph = ring_graph(n)
    elif form == "complete":
        graph = complete_graph(n)
    else:
        graph = edge_list_graph(text, n)
    validate_graph(graph, range(n))
    return graph


def edge_count(form: str, params: tuple, n: int, text: str = "") -> tuple[int, str]:
    """``(edges, formula)``: an upper bound on the edges building ``form`` (:func:`_parse_graph_spec`'s
    ``params``, edge list ``text``) on ``n`` agents creates."""
    pairs = n * (n - 1) // 2
    if form == "complete":
        return pairs, "N (N-1) / 2"
    if form == "class-overlap":
        kept = math.floor(params[0] * pairs + 1e-9)
        return pairs + kept, "all N (N-1) / 2 pairs + density of them"
    if form == "class-overlap-knn":
        k = params[0]
        return min(n * k + n // (k + 1), pairs), "N k + N / (k + 1) (joins)"
    if form == "random-regular":
        return n * params[0] // 2, "N k / 2"
    if form == "ring":
        return min(n, pairs), "N"
    return text.count(",") + 1, "the list's"


def check_graph_scale(spec: str, num_nodes: int) -> None:
    """Refuse (ValueError naming the sparse graphs), from the spec and ``N`` alone, a graph building
    more than :data:`MAX_GRAPH_EDGES` edges, or a malformed spec."""
    form, params = _parse_graph_spec(spec)
    n = int(num_nodes)
    edges, formula = edge_count(form, params, n, str(spec))
    if edges > MAX_GRAPH_EDGES:
        raise ValueError(
            f"graph={str(spec).strip()!r} on N={n} agents builds {formula} = {edges} edges, each "
            f"evaluated both ways; more than {MAX_GRAPH_EDGES} (the complete graph on "
            f"{COMPLETE_MAX_NODES} agents) are refused. Use a sparse graph: "
            "graph='class-overlap-knn:4' (each agent linked to its 4 best-overlapping peers), "
            "graph='random-regular:4' or graph='ring'"
        )


def check_graph_spec(spec: str) -> None:
    """Syntax check of a graph spec (:data:`GRAPH_SPECS`) before any node is known; ValueError
    for an unknown form or a degree / density / seed that is not a number (named)."""
    _parse_graph_spec(spec)


def _parse_graph_spec(spec: str) -> tuple[str, tuple]:
    """``(form, params)``: ``(density,)``, ``(k, seed)`` or ``()``; raises as :func:`check_graph_spec`."""
    text = str(spec).strip()
    if text in ("ring", "complete"):
        return text, ()
    if text == "class-overlap":
        return text, (0.4,)
    if text.startswith("class-overlap:"):
        return "class-overlap", (_density(spec, text.split(":", 1)[1].strip()),)
    for form in ("class-overlap-knn", "random-regular"):
        if text.startswith(form + ":"):
            return form, _degree_and_seed(spec, text)
    if _EDGE_LIST_RE.fullmatch(text):
        return "edges", ()
    if _EDGE_CHARS_RE.fullmatch(text):
        _strict_edge_list(spec, text)
    raise ValueError(f"unknown graph spec {spec!r}; valid forms: {', '.join(GRAPH_SPECS)}")


def validate_graph(graph: nx.Graph, partition_ids: Iterable[int]) -> None:
    """Check that ``graph`` is a usable topology for ``partition_ids``.

    Raises:
        ValueError: a directed or multigraph, a self-loop, a node not a partition id, a missing
            partition id, no nodes, or not connected (each named).
    """
    import networkx as nx

    if graph.is_directed() or graph.is_multigraph():
        raise ValueError(
            f"topology must be an undirected simple nx.Graph, got {type(graph).__name__}"
        )
    ids = set(partition_ids)
    loops = sorted(u for u, _ in nx.selfloop_edges(graph))
    if loops:
        raise ValueError(f"graph has self-loops at nodes {loops}")
    unknown = sorted(set(graph.nodes) - ids, key=repr)
    if unknown:
        raise ValueError(f"graph node(s) {unknown} are not partition ids {sorted(ids, key=repr)}")
    missing = sorted(ids - set(graph.nodes), key=repr)
    if missing:
        raise ValueError(f"partition id(s) {missing} have no node in the graph")
    if graph.number_of_nodes() == 0:
        raise ValueError("graph has no nodes")
    components = [sorted(c) for c in nx.connected_components(graph)]
    if len(components) > 1:
        raise ValueError(
            f"graph is not connected: {len(components)} components {sorted(components)}"
        )
