"""Sheaf-FRL on the client (paper Alg. 1): the gluing loss plug-in and its handlers.

Every local epoch a node refits its incident restriction maps by Procrustes (Eq. 18) on its
neighbours' whitened pilots ``(K, d_j)`` and trains on CE + the local gluing penalty (Eq. 16); it
replies with its whitened pilots ``(K, d_i)``. Stability: notes/stability.md; the variants
(Alg. 2-4): notes/variants-privacy.md.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from ...client.common import (
    cached_pilots,
    from_numpy,
    store_pilots,
    task_device,
    to_numpy,
    whitened_pilots,
)
from ...client.handlers import ClientMethod, register_method_handlers
from ...client.loop import LossPlugin
from ...client.task import LocalTask, StalkModel, TaskFactory
from ...config import DEFAULTS, node_partition_id
from ...protocol import (
    CONFIG,
    LOW_VARIANCE_FRACTION,
    SEED,
    STRINGENT_EVAL_ARRAYS,
    STRINGENT_EVAL_LABELS,
    EdgeConfig,
    ProtocolError,
    array_record,
    as_int,
    pack_arrays,
    required,
)
from ...sheaf import EdgeTerm, check_pilots
from ...sheaf.gluing import gluing_penalty_terms
from ...sheaf.pilots import (
    PilotSelection,
    apply_selection,
    group_means,
    parseval,
    public_pilot_features,
)
from ...sheaf.procrustes import SvdCounter
from ...sheaf.variants import (
    PRIVACY_MODES,
    Received,
    edge_dim,
    edge_terms,
    init_map,
    outgoing_pilots,
)
from . import ACTION
from .config import SheafConfig
from .protocol import (
    OWN_PILOTS,
    PILOT_DESCRIBE,
    PILOT_FEATURES,
    PILOT_INDEX_DIGEST,
    PILOT_LABELS,
    PILOT_PUBLIC,
    PILOT_SELECTION,
    PILOTS,
    SVDS,
    TRANSPORTED,
    index_digest,
    unpack_neighbour_pilots,
    unpack_pilot_selection,
)

__all__ = [
    "SheafGluing",
    "SheafClient",
    "register_sheaf_handlers",
    "load_maps",
    "save_maps",
    "node_secret",
    "received_selection",
    "describe_pilots",
]


class SheafGluing(LossPlugin):
    """CE + the local gluing penalty of paper Eq. 16 (or its variants, notes/variants-privacy.md) on a pilot minibatch.

    Args:
        task: the node's task (its ``x_pilot (K, ...)``).
        lam: lambda >= 0 of this round (lambda_i = lambda / d_i inside the penalty).
        pilot_batch_size: pilot rows per step (the same rows of every neighbour's matrix).
        neighbour_pilots: ``{j: (K, d_j) or (K, d_e)}`` float32: what each neighbour sent toward this
            node (raw whitened or transported pilots); a neighbour without an entry adds no term.
        own_pilots: this node's cached whitened pilots ``(K, d_i)``, used for the first epoch's maps;
            None = compute them.
        variant: ``heterogeneous`` or ``homogeneous`` (resolved by the strategy).
        privacy: ``standard`` or ``stringent``.
        maps: the node's maps from earlier rounds ``{j: (rows, d_i)}``.
        selection: this round's pilot selection (paper App. B; None = every pilot): neighbours'
            matrices have ``selection.num_rows`` rows and own pilots are reduced the same way
            (:func:`flwr_sheaf.sheaf.pilots.apply_selection`).
        normalisation: ``"none"`` or ``"parseval"``: maps fitted on the polar factors of both pilot
            matrices (notes/variants-pilots.md).
        map_refit: ``"epoch"`` (maps fitted at each epoch's start on all pilots) or ``"step"`` (each
            step of at least two rows refits them on its minibatch, Alg. 1 line 11; :attr:`maps` stay
            the epoch fits).

    Attributes:
        residual: per neighbour, the summed per-step mean squared residual.
        maps: the node's current maps (what :meth:`SheafClient.after_train` transports with).
        svds: SVDs computed for the maps this round.

    Raises:
        ProtocolError: pilots from a partition-id that is not a neighbour.
        ValueError: a neighbour's matrix with the wrong K or width, or NaN/inf entries (named).
    """

    def __init__(
        self,
        task: LocalTask,
        lam: float,
        pilot_batch_size: int,
        edges: EdgeConfig,
        neighbour_pilots: dict[int, torch.Tensor],
        own_pilots: torch.Tensor | None,
        variant: str,
        privacy: str,
        maps: dict[int, torch.Tensor] | None = None,
        selection: PilotSelection | None = None,
        normalisation: str = "none",
        map_refit: str = DEFAULTS["map-refit"],
    ) -> None:
        unknown = sorted(set(neighbour_pilots) - set(edges.neighbours))
        if unknown:
            raise ProtocolError(
                f"received pilots from partition-id(s) {unknown} that are not neighbours"
            )
        if normalisation not in ("none", "parseval"):
            raise ValueError(f"pilot-normalisation={normalisation!r}: must be 'none' or 'parseval'")
        if map_refit not in ("epoch", "step"):
            raise ValueError(f"map-refit={map_refit!r}: must be 'epoch' or 'step'")
        self.selection, self.map_refit = selection, map_refit
        self.normalise = parseval if normalisation == "parseval" else None
        k = task.x_pilot.shape[0] if selection is None else selection.num_rows
        d_i = int(task.model.d)
        weights = edges.weights or (1.0,) * len(edges.neighbours)
        self.active = [
            (j, hd, w)
            for j, hd, w in zip(edges.neighbours, edges.heads, weights)
            if j in neighbour_pilots
        ]
        for j, dj in zip(edges.neighbours, edges.dims):
            if j in neighbour_pilots:
                width = edge_dim(d_i, dj) if privacy == "stringent" else dj
                check_pilots(
                    neighbour_pilots[j], f"pilots of neighbour partition-id {j}", d=width, k=k
                )
        self.task, self.lam, self.batch = task, float(lam), int(pilot_batch_size)
        self.pilots, self.own = neighbour_pilots, own_pilots
        self.variant, self.privacy = variant, privacy
        self.terms: list[EdgeTerm] = []
        self.maps: dict[int, torch.Tensor] = dict(maps or {})
        self.svds = 0
        self._residual_steps: dict[int, list[tuple[torch.Tensor, int]]] = {
            j: [] for j, _, _ in self.active
        }
        self._plan: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def begin_epoch(self, model: StalkModel, epoch: int) -> None:
        """Refit the maps this node owns on the current pilots (Eq. 18; Alg. 2 lines 8-10; P2c/P2d)."""
        self.terms = []
        if not self.active or self.lam <= 0:
            return
        own = (
            self.own
            if (epoch == 0 and self.own is not None)
            else whitened_pilots(model, self.task.x_pilot)[1]
        )
        own = apply_selection(own, self.selection)
        received = [Received(j, self.pilots[j], hd, float(w)) for j, hd, w in self.active]
        self.terms, fitted = self._edge_terms(own, received)
        self.maps.update({j: m.detach().double().cpu() for j, m in fitted.items()})

    def _edge_terms(
        self, own: torch.Tensor, received: list[Received]
    ) -> tuple[list[EdgeTerm], dict[int, torch.Tensor]]:
        """:func:`~flwr_sheaf.sheaf.variants.edge_terms` in this node's mode, counting SVDs."""
        with SvdCounter() as c:
            out = edge_terms(own, received, self.variant, self.privacy, self.normalise)
        self.svds += c.n
        return out

    def plan_epoch(self, steps: int, gen: torch.Generator) -> None:
        """Draw the epoch's pilot minibatches from ``gen`` (as :meth:`loss` would) and move them to the device in one copy."""
        self._plan = []
        if not self.terms:
            return
        sel = self.selection
        m = self.task.x_pilot.shape[0] if sel is None else int(sel.indices.size)
        pidx = torch.stack([torch.randperm(m, generator=gen)[: self.batch] for _ in range(steps)])
        rows = pidx if sel is None else torch.as_tensor(sel.indices)[pidx]
        groups = None if sel is None or sel.groups is None else torch.as_tensor(sel.groups)[pidx]
        dev = self.task.x_pilot.device
        both = torch.stack([pidx, rows]).to(dev)  # one host-to-device copy per epoch
        self._plan = [
            (both[0, s], both[1, s], None if groups is None else groups[s]) for s in range(steps)
        ]
        self._plan.reverse()  # popped in step order

    def loss(self, model, x, y, gen):
        """``(CE + R_A|_i, parts)``: the Eq. 16 penalty on a pilot minibatch (encoder in eval mode,
        whitening in train mode; notes/stability.md); parts are detached tensors.
        """
        ce = F.cross_entropy(model.private_logits(x), y)
        parts = {"ce": ce.detach(), "gluing": 0.0}
        if not self.terms:
            return ce, parts
        dev = self.task.x_pilot.device
        if not self._plan:  # called outside train_local's epoch plan: draw this step's rows now
            self.plan_epoch(1, gen)
        pidx, rows, g = self._plan.pop()
        model.eval()  # dropout-free, BatchNorm running statistics ...
        model.whitening.train()  # ... but differentiable batch whitening of the pilots
        # on a GPU: the loop's per-epoch check
        with model.whitening.finite_checks(dev.type == "cpu"):
            a_i = model.whitening(model.latent(self.task.x_pilot[rows]))
        nrows = pidx
        if g is not None:  # prototypes: minibatch means of the groups present
            present, inv = torch.unique(g, return_inverse=True)
            a_i = group_means(a_i, inv, int(present.numel()))
            nrows = present
        terms = [
            EdgeTerm(t.neighbour, t.pilots[nrows.to(t.pilots.device)], t.v, t.i_is_head, t.weight)
            for t in self.terms
        ]
        # Alg. 1 line 11: maps of the current pilots
        if self.map_refit == "step" and a_i.shape[0] >= 2:
            received = [Received(t.neighbour, t.pilots, t.i_is_head, t.weight) for t in terms]
            terms, _ = self._edge_terms(a_i.detach(), received)
        pen, per_edge = gluing_penalty_terms(a_i, terms, self.lam, check_finite=dev.type == "cpu")
        model.train()
        for j, sq in per_edge.items():
            self._residual_steps[j].append((sq, int(a_i.shape[0])))
        parts["gluing"] = pen.detach()
        return ce + pen, parts

    @property
    def residual(self) -> dict[int, float]:
        """Per neighbour partition-id: the sum over this round's steps of ``||.||_F^2 / K_step``."""
        return {j: _residual_sum(v) for j, v in self._residual_steps.items()}

    def metrics(self, steps: int) -> dict:
        """Per-edge mean squared residuals (``edge-neighbour``, ``edge-residual``, aligned lists) and ``svds``."""
        return {
            "edge-neighbour": [j for j, _, _ in self.active],
            "edge-residual": [
                _residual_sum(self._residual_steps[j]) / max(steps, 1) for j, _, _ in self.active
            ],
            SVDS: int(self.svds),
        }


def _residual_sum(steps_sq: list[tuple[torch.Tensor, int]]) -> float:
    """Sum over steps of ``||.||_F^2 / K_step`` (one device read, summed in step order in float64)."""
    if not steps_sq:
        return 0.0
    host = torch.stack([sq.to(torch.float64) for sq, _ in steps_sq]).cpu().tolist()
    total = 0.0
    for sq, (_, rows) in zip(host, steps_sq):
        total += sq / rows
    return total


def _maps_key(action: str) -> str:
    return f"{action}.maps"


def load_maps(context: Context, action: str) -> dict[int, torch.Tensor]:
    """The node's maps in ``context.state`` (``{j: float64 (rows, d_i)}``; empty if none)."""
    key = _maps_key(action)
    if key not in context.state:
        return {}
    rec = array_record(context.state, key)
    return {int(k): from_numpy(rec[k].numpy().copy()) for k in rec.keys() if k.isdigit()}


def save_maps(context: Context, action: str, maps: dict[int, torch.Tensor]) -> None:
    """Keep the node's maps ``{j: (rows, d_i)}`` in ``context.state`` (float64)."""
    context.state[_maps_key(action)] = pack_arrays(
        {str(int(j)): to_numpy(m.double()) for j, m in maps.items()}
    )


def node_secret(context: Context, action: str) -> int:
    """The node's 63-bit map-initialisation secret: node-config ``privacy-secret``, else drawn once
    from the OS and kept in ``context.state``.
    """
    if "privacy-secret" in context.node_config:
        return int(context.node_config["privacy-secret"]) & (2**63 - 1)
    key = f"{action}.privacy-secret"
    if key not in context.state:
        context.state[key] = pack_arrays(
            {"secret": np.array([secrets.randbits(63)], dtype=np.int64)}
        )
    return int(array_record(context.state, key)["secret"].numpy()[0])


def _upload_maps(
    context: Context,
    action: str,
    maps: dict[int, torch.Tensor],
    edges: EdgeConfig,
    d_i: int,
    variant: str,
    privacy: str,
    seed: int,
) -> dict[int, torch.Tensor]:
    """``maps`` plus the initial map of every edge not fitted yet: identity (Alg. 2) or keyed Haar (Alg. 3/4 line 1)."""
    out = dict(maps)
    pid = node_partition_id(context)
    for j, dj, i_head in zip(edges.neighbours, edges.dims, edges.heads):
        rows = edge_dim(d_i, dj) if privacy == "stringent" else dj
        if j in out and tuple(out[j].shape) == (rows, d_i):
            continue
        if privacy == "stringent":
            out[j] = init_map(rows, d_i, (seed, pid, j, node_secret(context, action)))
        elif variant == "homogeneous" and not i_head:
            out[j] = torch.eye(d_i, dtype=torch.float64)
    return out


class SheafClient(ClientMethod):
    """Sheaf-FRL's hooks: gluing plug-in in; whitened pilots (or transported pilots) out (module docstring)."""

    def plugin(self, msg: Message, context: Context, task: LocalTask) -> LossPlugin:
        """:class:`SheafGluing` from the message's :class:`~flwr_sheaf.config.SheafConfig`, edges and
        neighbours' pilots (paper Alg. 1 line 3, Alg. 2-4 line 6).

        Raises:
            ConfigError / ProtocolError: a missing key, malformed edges, pilots of a non-neighbour,
                ``auto`` not resolved, raw pilots in a stringent message.
            ValueError: neighbour pilots with the wrong K or width, or NaN/inf (named).
        """
        cfg = msg.content[CONFIG]
        sheaf = SheafConfig.from_record(cfg)
        if sheaf.sheaf_variant == "auto":
            raise ProtocolError(
                "train message has sheaf-variant='auto': the strategy must resolve it at discovery"
            )
        if sheaf.privacy == "stringent" and PILOTS in msg.content:
            raise ProtocolError(
                "privacy='stringent' but the train message carries raw neighbour pilots"
            )
        received, moved = (
            unpack_neighbour_pilots(array_record(msg.content, k)) if k in msg.content else {}
            for k in (PILOTS, TRANSPORTED)
        )
        both = sorted(set(received) & set(moved))
        if both:
            raise ProtocolError(f"neighbour(s) {both} sent both raw and transported pilots")
        received.update(moved)
        dev = task_device(task)
        cached = cached_pilots(context, self.action, dev)
        return SheafGluing(
            task,
            sheaf.lam,
            sheaf.pilot_batch_size,
            EdgeConfig.from_config(cfg),
            {j: from_numpy(a, dev) for j, a in received.items()},
            None if cached is None else cached[0],
            sheaf.sheaf_variant,
            sheaf.privacy,
            load_maps(context, self.action),
            selection=received_selection(msg, int(task.x_pilot.shape[0])),
            normalisation=sheaf.pilot_normalisation,
            map_refit=sheaf.map_refit,
        )

    def after_train(
        self, msg: Message, context: Context, task: LocalTask, plugin: LossPlugin
    ) -> tuple[dict, dict]:
        """Fit the whitening, cache and upload the whitened pilots ``(K, d_i)`` (Alg. 1 line 13) and/or
        the per-edge transported pilots (Alg. 2-4 line 6); keep the maps. Metrics:
        ``low-variance-fraction`` (collapse diagnostic), ``svds``.
        """
        assert isinstance(plugin, SheafGluing)  # made by self.plugin
        cfg = msg.content[CONFIG]
        sheaf = SheafConfig.from_record(cfg)
        edges = EdgeConfig.from_config(cfg)
        z, a = whitened_pilots(task.model, task.x_pilot)
        lvf = store_pilots(context, self.action, z, a)
        d_i = int(task.model.d)
        maps = _upload_maps(
            context,
            self.action,
            plugin.maps,
            edges,
            d_i,
            sheaf.sheaf_variant,
            sheaf.privacy,
            as_int(cfg[SEED], SEED),
        )
        send_raw, moved = outgoing_pilots(
            a.double().cpu(),
            maps,
            edges.neighbours,
            edges.heads,
            sheaf.sheaf_variant,
            sheaf.privacy,
        )
        if sheaf.privacy == "stringent" or sheaf.sheaf_variant == "homogeneous":
            # the maps this node transports with (Alg. 1 keeps none)
            save_maps(context, self.action, maps)
        records = {}
        if send_raw:
            records[PILOTS] = pack_arrays({OWN_PILOTS: to_numpy(a)})
        if moved:
            records[TRANSPORTED] = pack_arrays(
                {str(j): to_numpy(m.float()) for j, m in moved.items()}
            )
        metrics = {LOW_VARIANCE_FRACTION: lvf, SVDS: int(plugin.svds)}
        sel = getattr(plugin, "selection", None)
        if sel is not None:  # echo the selection this node used: the strategy refuses a mismatch
            metrics[PILOT_INDEX_DIGEST] = index_digest(sel.indices, sel.groups)
        if PILOT_DESCRIBE in cfg:
            records[PILOT_PUBLIC] = describe_pilots(task, str(cfg[PILOT_DESCRIBE]))
        return records, metrics

    def evaluation_reply(
        self, msg: Message, context: Context, task: LocalTask, arrays: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Under ``privacy = stringent``: the phase-1 arrays moved by the node's own map toward each
        neighbour j (``"<j>/pilots"``, ``"<j>/test-latents"``, ``"<j>/val-latents"``, width d_e) plus
        the labels, no raw arrays. Otherwise ``arrays`` unchanged.

        Raises:
            ProtocolError: no or an unknown ``privacy``; stringent without the edge config or ``seed``.
        """
        cfg = msg.content[CONFIG]
        privacy = str(required(cfg, "privacy", "evaluate." + self.action))
        if privacy not in PRIVACY_MODES:
            raise ProtocolError(
                f"evaluation config privacy={privacy!r}: must be one of {PRIVACY_MODES}"
            )
        if privacy == "standard":
            return arrays
        edges = EdgeConfig.from_config(cfg)
        d_i = int(task.model.d)
        maps = _upload_maps(
            context,
            self.action,
            load_maps(context, self.action),
            edges,
            d_i,
            "heterogeneous",
            "stringent",
            int(required(cfg, SEED, "evaluate." + self.action)),
        )
        out = {name: arrays[name] for name in STRINGENT_EVAL_LABELS}
        for j in edges.neighbours:
            x = to_numpy(maps[j])
            for name in STRINGENT_EVAL_ARRAYS:
                out[f"{j}/{name}"] = (arrays[name].astype(np.float64) @ x.T).astype(np.float32)
        save_maps(context, self.action, maps)
        return out


def received_selection(msg: Message, num_pilots: int) -> PilotSelection | None:
    """The pilot selection of a ``train.sheaf`` message (None: every pilot).

    Raises:
        ProtocolError: a selection record without the config's ``PILOT_INDEX_DIGEST`` (or the
            reverse), or indices whose digest differs from it.
    """
    cfg = msg.content[CONFIG]
    has_rec, has_digest = PILOT_SELECTION in msg.content, PILOT_INDEX_DIGEST in cfg
    if has_rec != has_digest:
        raise ProtocolError(
            f"train message has {'record ' + repr(PILOT_SELECTION) if has_rec else 'config key ' + repr(PILOT_INDEX_DIGEST)}"
            f" without {'config key ' + repr(PILOT_INDEX_DIGEST) if has_rec else 'record ' + repr(PILOT_SELECTION)}"
        )
    if not has_rec:
        return None
    idx, grp = unpack_pilot_selection(
        array_record(msg.content, PILOT_SELECTION),
        as_int(cfg[PILOT_INDEX_DIGEST], PILOT_INDEX_DIGEST),
        num_pilots,
    )
    return PilotSelection(idx, grp)


def describe_pilots(task: LocalTask, what: str):
    """Record ``PILOT_PUBLIC``: the pilots' labels (``what="class"``) or public features (``"cluster"``).

    Raises:
        ProtocolError: an unknown ``what``; ``"class"`` with ``y_pilot`` None.
    """
    if what == "class":
        if task.y_pilot is None:
            raise ProtocolError(
                "pilot-strategy *-class needs the pilots' labels: this node's LocalTask has y_pilot=None"
            )
        return pack_arrays({PILOT_LABELS: to_numpy(task.y_pilot).astype("int64")})
    if what == "cluster":
        return pack_arrays(
            {PILOT_FEATURES: public_pilot_features(to_numpy(task.x_pilot)).astype("float32")}
        )
    raise ProtocolError(f"{PILOT_DESCRIBE}={what!r}: must be 'class' or 'cluster'")


def register_sheaf_handlers(
    app: ClientApp, factory: TaskFactory, action: str = ACTION
) -> ClientApp:
    """Add Sheaf-FRL's handlers under ``action`` (pair with :class:`flwr_sheaf.methods.sheaf_frl.strategy.SheafFRL`)."""
    return register_method_handlers(app, factory, SheafClient(action))
