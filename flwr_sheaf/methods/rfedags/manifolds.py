"""Manifolds for RFedAGS and its baselines (numpy in, float64 out; notes/baselines-rfedags.md, s5.4):
Stiefel, sphere (via geoopt), SPD and the Poincaré ball (numpy closed forms of geoopt's, the tests'
oracles). Leading batch axes broadcast; points are validated only by ``check_point``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["Manifold", "Stiefel", "Sphere", "SPD", "PoincareBall"]


def _geoopt() -> Any:
    """geoopt, imported lazily: its import costs 0.3-0.5 CPU-s in every Ray actor
    (benchmarks/records/performance-ray.md, "Against Flower's floor")."""
    with warnings.catch_warnings():
        # geoopt 0.5 decorates helpers with torch.jit.script, deprecated in recent torch.
        warnings.simplefilter("ignore", FutureWarning)
        import geoopt
    return geoopt


def _torch(f: Any, *arrays: np.ndarray) -> np.ndarray:
    """``f(*tensors).numpy()`` (a geoopt map) on float64 ``arrays``, with one intra-op thread.

    The matrices are tiny: torch's OpenMP barriers made a 1500-round test 10-20x slower on a loaded
    2-core machine. Read-only inputs are copied (``torch.from_numpy`` shares memory).
    """
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        return f(*(torch.from_numpy(a if a.flags.writeable else a.copy()) for a in arrays)).numpy()
    finally:
        if n != 1:
            torch.set_num_threads(n)


class Manifold:
    """The operations RFedAGS needs from a manifold (notes/baselines-rfedags.md, s5.2 and s5.4).

    Subclasses set ``point_shape``, ``_geo`` (geoopt backend or the tests' reference),
    ``_constraint`` (named in errors) and ``compact_embedded`` (RFedProj applies), and implement the
    operations below (``log`` / ``dist`` optional, for Fréchet means).

    Attributes:
        retr: ``(x, u) ->`` the retraction ``R_x(u)`` of a tangent vector; point(s) ``(..., *point_shape)``.
        transp: ``(x, y, v) ->`` the transport of ``v in T_x M`` to ``T_y M``; shape of ``v``.
        inner: ``(x, u, v) ->`` the metric ``<u, v>_x`` per batch element; shape ``(...)``.
        invretr: ``(x, y) ->`` the inverse retraction at ``x`` of point(s) ``y``; shape of ``y``.
        random_point: ``(rng) ->`` a random point of shape ``point_shape`` drawn with ``rng``.
        feasibility: ``(x) ->`` distance of ``x`` from the constraint per batch element (0 on ``M``).
        tangent_error: ``(x, u) ->`` distance of ``u`` from ``T_x M`` per batch element (0 if tangent).
    """

    point_shape: tuple[int, ...]
    compact_embedded = False
    _constraint: str
    _geo: Any
    retr: Callable[[np.ndarray, np.ndarray], np.ndarray]
    transp: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
    inner: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
    invretr: Callable[[np.ndarray, np.ndarray], np.ndarray]
    random_point: Callable[[np.random.Generator], np.ndarray]
    feasibility: Callable[[np.ndarray], np.ndarray]
    tangent_error: Callable[[np.ndarray, np.ndarray], np.ndarray]

    def _arr(self, a: np.ndarray, name: str) -> np.ndarray:
        """float64 contiguous copy of ``a``; ValueError if its trailing shape is not ``point_shape``."""
        out = np.ascontiguousarray(np.asarray(a, dtype=np.float64))
        k = len(self.point_shape)
        if out.shape[-k:] != self.point_shape:
            raise ValueError(
                f"{name}: expected shape (..., {', '.join(map(str, self.point_shape))}) on {self!r}, got {out.shape}"
            )
        return out

    def proj(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Tangent projection at ``x`` (Stiefel: ``U - X sym(X^T U)``; sphere: ``u - <x, u> x``).

        ``x`` and ``u`` are ``(..., *point_shape)`` and broadcast; returns float64 of the broadcast
        shape; ValueError on a trailing shape other than ``point_shape``.
        """
        return _torch(self._geo.proju, self._arr(x, "point x"), self._arr(u, "vector u"))

    def egrad2rgrad(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Riemannian gradient of the embedded metric: ``proj(x, g)`` (notes/baselines-rfedags.md, s5.2)."""
        return self.proj(x, g)

    def rgrad2egrad(self, x: np.ndarray, v: np.ndarray) -> np.ndarray:
        """A Euclidean gradient whose Riemannian gradient is the tangent ``v`` (embedded metric: ``v``)."""
        return self.proj(x, v)

    def check_point(self, x: np.ndarray, atol: float = 1e-8) -> None:
        """Raise ``ValueError`` unless ``x`` has shape ``(..., *point_shape)``, is finite and
        :meth:`feasibility` is at most ``atol``."""
        x = self._arr(x, "point x")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"point x on {self!r} has NaN/inf entries")
        err = float(np.max(self.feasibility(x)))
        if err > atol:
            raise ValueError(
                f"point x is off {self!r}: {self._constraint} = {err:.3e} > atol={atol}"
            )


class ProjectionManifold(Manifold):
    """A :class:`Manifold` with a metric projection ``ambient_projection(z)`` onto ``M`` (RFedProj's
    requirement, :func:`~.baselines.require_projection`; notes/baselines-rfedags.md, s5.4)."""

    compact_embedded = True
    ambient_projection: Callable[[np.ndarray], np.ndarray]


class Stiefel(ProjectionManifold):
    """Stiefel manifold ``St(d, r) = {X in R^{d x r}: X^T X = I_r}``, embedded metric, sign-fixed QR
    retraction, projection transport; points ``(..., d, r)``; ValueError unless ``d >= r >= 1``."""

    def __init__(self, d: int, r: int) -> None:
        if int(r) != r or int(d) != d or r < 1 or d < r:
            raise ValueError(f"Stiefel(d, r) needs integers d >= r >= 1, got d={d}, r={r}")
        self.d, self.r = int(d), int(r)
        self.point_shape = (self.d, self.r)
        self._geo = _geoopt().EuclideanStiefel()
        self._constraint = "||X^T X - I||_F"

    def __repr__(self) -> str:
        return f"Stiefel(d={self.d}, r={self.r})"

    def retr(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """QR retraction ``qf(X + U)``, sign-fixed so ``diag(R) >= 0``; ValueError on a bad shape."""
        x, u = self._arr(x, "point x"), self._arr(u, "vector u")
        return _torch(self._geo.retr, x, u)

    def transp(self, x: np.ndarray, y: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Projection vector transport ``T_{x->y}(v) = P_y(v)`` (Manopt ``transp``)."""
        self._arr(x, "point x")
        return _torch(self._geo.proju, self._arr(y, "point y"), self._arr(v, "vector v"))

    def invretr(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Inverse QR retraction: the ``U in T_X St`` with ``qf(X + U) = Y`` (Manopt ``invretr_qr``).

        Solves ``M R + R^T M^T = 2 I`` (``M = X^T Y``) for upper-triangular ``R``; ``U = Y R - X``.
        ``x``: one ``(d, r)`` point; ``y``: ``(d, r)`` or ``(m, d, r)``; returns float64 of ``y``'s shape.

        Raises:
            ValueError: wrong shapes, or ``Y`` not reachable from ``X`` (singular system or
                ``diag(R) <= 0``).
        """
        x, y = self._arr(x, "point x"), self._arr(y, "point y")
        if x.ndim != 2:
            raise ValueError(f"invretr: base point must be one (d, r) point, got shape {x.shape}")
        r = self.r
        ys = y.reshape(-1, self.d, r)
        m = np.swapaxes(x, -1, -2) @ ys  # (B, r, r)
        # equation (a, b), a <= b; unknown R[i, j], i <= j (same ordering)
        ia, ib = np.triu_indices(r)
        ii, jj = ia, ib
        # (M E_ij + E_ij^T M^T)[a, b] = M[a, i] [b = j] + [a = j] M[b, i]
        a = (
            m[:, ia[:, None], ii[None, :]] * (ib[:, None] == jj[None, :])
            + (ia[:, None] == jj[None, :]) * m[:, ib[:, None], ii[None, :]]
        )
        rhs = np.broadcast_to(2.0 * (ia == ib).astype(np.float64), (ys.shape[0], ia.size))
        try:
            sol = np.linalg.solve(a, rhs[..., None])[..., 0]
        except np.linalg.LinAlgError:
            raise ValueError(
                f"invretr on {self!r}: Y is not reachable from X by the QR retraction (singular X^T Y)"
            ) from None
        rr = np.zeros((ys.shape[0], r, r))
        rr[:, ia, ib] = sol
        if np.any(np.diagonal(rr, axis1=-2, axis2=-1) <= 0) or not np.all(np.isfinite(rr)):
            raise ValueError(
                f"invretr on {self!r}: Y is not reachable from X by the QR retraction (diag(R) <= 0)"
            )
        return (ys @ rr - x).reshape(y.shape)

    def ambient_projection(self, z: np.ndarray) -> np.ndarray:
        """Polar factor ``U V^T`` of ``Z = U S V^T`` (``RFedProj_.m`` ``Proj``); ValueError on a
        bad shape or NaN/inf."""
        z = self._arr(z, "ambient z")
        if not np.all(np.isfinite(z)):
            raise ValueError(f"ambient_projection on {self!r}: NaN/inf entries")
        u, _, vt = np.linalg.svd(z, full_matrices=False)
        return u @ vt

    def inner(self, x: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Euclidean metric ``tr(U^T V)`` per batch element, ``(...)``."""
        u, v = self._arr(u, "vector u"), self._arr(v, "vector v")
        return np.sum(u * v, axis=(-2, -1))

    def random_point(self, rng: np.random.Generator) -> np.ndarray:
        """Haar-distributed ``qf(G)``, ``G`` standard normal ``(d, r)``."""
        g = rng.standard_normal(self.point_shape)
        return self.retr(np.zeros(self.point_shape), g)

    def feasibility(self, x: np.ndarray) -> np.ndarray:
        """``||X^T X - I_r||_F`` per batch element."""
        x = self._arr(x, "point x")
        gram = np.swapaxes(x, -1, -2) @ x
        return np.linalg.norm(gram - np.eye(self.r), axis=(-2, -1))

    def tangent_error(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """``||sym(X^T U)||_F`` per batch element."""
        x, u = self._arr(x, "point x"), self._arr(u, "vector u")
        xtu = np.swapaxes(x, -1, -2) @ u
        return np.linalg.norm(0.5 * (xtu + np.swapaxes(xtu, -1, -2)), axis=(-2, -1))


class Sphere(ProjectionManifold):
    """Unit sphere ``S^{n-1}`` with the embedded metric; points ``(..., n)``.

    Args:
        n: ambient dimension, ``n >= 2``.
        retraction: ``"normalize"`` (Manopt ``spherefactory``: ``(x+u)/||x+u||``) or ``"exp"``.
        transport: ``"projection"`` (``v - <y, v> y``) or ``"parallel"``
            (``v - <y, v>/(1 + <x, y>) (x + y)``; undefined for antipodal points).

    Raises:
        ValueError: bad ``n``, unknown ``retraction``/``transport``.
    """

    def __init__(
        self, n: int, retraction: str = "normalize", transport: str = "projection"
    ) -> None:
        if int(n) != n or n < 2:
            raise ValueError(f"Sphere(n) needs an integer n >= 2, got n={n}")
        if retraction not in ("normalize", "exp"):
            raise ValueError(f"retraction must be 'normalize' or 'exp', got {retraction!r}")
        if transport not in ("projection", "parallel"):
            raise ValueError(f"transport must be 'projection' or 'parallel', got {transport!r}")
        self.n = int(n)
        self.point_shape = (self.n,)
        self.retraction, self.transport = retraction, transport
        self._geo = _geoopt().Sphere()
        self._constraint = "| ||x|| - 1 |"

    def __repr__(self) -> str:
        return f"Sphere(n={self.n}, retraction={self.retraction!r}, transport={self.transport!r})"

    def retr(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Retraction (normalisation or exponential map)."""
        x, u = self._arr(x, "point x"), self._arr(u, "vector u")
        f = self._geo.expmap if self.retraction == "exp" else self._geo.retr
        return _torch(f, x, u)

    def transp(self, x: np.ndarray, y: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Vector transport ``T_{x->y}(v)``; ValueError for parallel transport of antipodal points."""
        x, y, v = self._arr(x, "point x"), self._arr(y, "point y"), self._arr(v, "vector v")
        if self.transport == "projection":
            return _torch(self._geo.proju, y, v)
        xy = np.sum(x * y, axis=-1, keepdims=True)
        if np.any(1.0 + xy < 1e-12):
            raise ValueError("parallel transport on the sphere is undefined for antipodal x, y")
        return v - np.sum(y * v, axis=-1, keepdims=True) / (1.0 + xy) * (x + y)

    def log(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``Log_x(y) = theta (y - <x, y> x)/||y - <x, y> x||``, ``theta = arccos <x, y>``.

        Raises:
            ValueError: antipodal ``x, y`` or a trailing shape other than ``(n,)``.
        """
        x, y = self._arr(x, "point x"), self._arr(y, "point y")
        c = np.clip(np.sum(x * y, axis=-1, keepdims=True), -1.0, 1.0)
        if np.any(c < -1.0 + 1e-12):
            raise ValueError("Log on the sphere is undefined for antipodal points")
        w = y - c * x
        nw = np.linalg.norm(w, axis=-1, keepdims=True)
        theta = np.arccos(c)
        return np.where(nw > 1e-300, theta * w / np.where(nw > 1e-300, nw, 1.0), 0.0)

    def dist(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Geodesic distance ``arccos <x, y>``, ``(...)``."""
        x, y = self._arr(x, "point x"), self._arr(y, "point y")
        return np.arccos(np.clip(np.sum(x * y, axis=-1), -1.0, 1.0))

    def invretr(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`retr`: ``y/<x, y> - x`` (normalisation) or :meth:`log` (``"exp"``).

        Raises:
            ValueError: ``<x, y> <= 0`` with the normalisation retraction.
        """
        if self.retraction == "exp":
            return self.log(x, y)
        x, y = self._arr(x, "point x"), self._arr(y, "point y")
        c = np.sum(x * y, axis=-1, keepdims=True)
        if np.any(c <= 0):
            raise ValueError(
                f"invretr on {self!r}: <x, y> <= 0, y is not reachable by the normalisation retraction"
            )
        return y / c - x

    def ambient_projection(self, z: np.ndarray) -> np.ndarray:
        """Metric projection ``z/||z||``; ValueError for ``z = 0`` or NaN/inf."""
        z = self._arr(z, "ambient z")
        nz = np.linalg.norm(z, axis=-1, keepdims=True)
        if not np.all(np.isfinite(z)) or np.any(nz == 0):
            raise ValueError(f"ambient_projection on {self!r}: zero or non-finite vector")
        return z / nz

    def inner(self, x: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Euclidean inner product ``<u, v>`` per batch element, ``(...)``."""
        u, v = self._arr(u, "vector u"), self._arr(v, "vector v")
        return np.sum(u * v, axis=-1)

    def random_point(self, rng: np.random.Generator) -> np.ndarray:
        """Uniform unit vector ``(n,)`` (normalised standard normal)."""
        g = rng.standard_normal(self.point_shape)
        return g / np.linalg.norm(g)

    def feasibility(self, x: np.ndarray) -> np.ndarray:
        """``| ||x|| - 1 |`` per batch element."""
        x = self._arr(x, "point x")
        return np.abs(np.linalg.norm(x, axis=-1) - 1.0)

    def tangent_error(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """``|<x, u>|`` per batch element."""
        x, u = self._arr(x, "point x"), self._arr(u, "vector u")
        return np.abs(np.sum(x * u, axis=-1))


def _sym(a: np.ndarray) -> np.ndarray:
    return 0.5 * (a + np.swapaxes(a, -1, -2))


def _eigfun(a: np.ndarray, *fs) -> list[np.ndarray]:
    """``[V f(L) V^T for f in fs]`` for the symmetric part of ``a = V diag(L) V^T`` (batched ``eigh``)."""
    lam, vec = np.linalg.eigh(_sym(a))
    vt = np.swapaxes(vec, -1, -2)
    return [(vec * f(lam)[..., None, :]) @ vt for f in fs]


class SPD(Manifold):
    """SPD ``n x n`` matrices, affine-invariant metric ``tr(X^{-1} U X^{-1} V)`` (Manopt
    ``sympositivedefinitefactory``; notes/baselines-rfedags.md, s5.4); points ``(..., n, n)``.

    Numpy closed forms of geoopt's ``SymmetricPositiveDefinite("AIM")`` (retraction = exponential
    map; 50x faster than geoopt's torch on 3 x 3 batches). Not compact: RFedProj refuses it.
    ValueError unless ``n >= 1``.
    """

    def __init__(self, n: int) -> None:
        if int(n) != n or n < 1:
            raise ValueError(f"SPD(n) needs an integer n >= 1, got n={n}")
        self.n = int(n)
        self.point_shape = (self.n, self.n)
        self._geo = _geoopt().SymmetricPositiveDefinite("AIM")  # the reference
        self._constraint = "||X - X^T||_F (inf if not positive definite)"

    def __repr__(self) -> str:
        return f"SPD(n={self.n}, metric='affine-invariant')"

    def _roots(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s, si = _eigfun(x, np.sqrt, lambda w: 1.0 / np.sqrt(w))
        return s, si

    def proj(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """``sym(U)`` broadcast against ``x``."""
        x, u = self._arr(x, "point x"), self._arr(u, "vector u")
        return np.broadcast_to(_sym(u), np.broadcast_shapes(x.shape, u.shape)).copy()

    def egrad2rgrad(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        """``X sym(G) X``."""
        x, g = self._arr(x, "point x"), self._arr(g, "gradient g")
        return x @ _sym(g) @ x

    def rgrad2egrad(self, x: np.ndarray, v: np.ndarray) -> np.ndarray:
        """``X^{-1} sym(V) X^{-1}`` (inverse of ``egrad2rgrad``)."""
        x, v = self._arr(x, "point x"), self._arr(v, "vector v")
        xi = np.linalg.inv(x)
        return xi @ _sym(v) @ xi

    def retr(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Exponential map ``Exp_X(U)`` (the authors' retraction on SPD)."""
        x, u = self._arr(x, "point x"), self._arr(u, "vector u")
        s, si = self._roots(x)
        return _sym(s @ _eigfun(si @ u @ si, np.exp)[0] @ s)

    def log(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Riemannian logarithm ``Log_X(Y)``."""
        x, y = self._arr(x, "point x"), self._arr(y, "point y")
        s, si = self._roots(x)
        return _sym(s @ _eigfun(si @ y @ si, np.log)[0] @ s)

    #: the retraction is the exponential map: its inverse is the logarithm
    invretr = log

    def dist(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``||logm(X^{-1/2} Y X^{-1/2})||_F`` per batch element."""
        x, y = self._arr(x, "point x"), self._arr(y, "point y")
        _, si = self._roots(x)
        lam = np.linalg.eigvalsh(_sym(si @ y @ si))
        return np.sqrt(np.sum(np.log(lam) ** 2, axis=-1))

    def transp(self, x: np.ndarray, y: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Parallel transport of ``V`` from ``T_X`` to ``T_Y`` (geoopt's formula)."""
        x, y, v = self._arr(x, "point x"), self._arr(y, "point y"), self._arr(v, "vector v")
        s, si = self._roots(x)
        e = _eigfun(si @ y @ si, np.sqrt)[0]
        return _sym(s @ e @ _sym(si @ v @ si) @ e @ s)

    def inner(self, x: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """``tr(X^{-1} U X^{-1} V)`` per batch element."""
        x, u, v = self._arr(x, "point x"), self._arr(u, "vector u"), self._arr(v, "vector v")
        xi = np.linalg.inv(x)
        return np.trace(xi @ u @ xi @ v, axis1=-2, axis2=-1)

    def random_point(self, rng: np.random.Generator) -> np.ndarray:
        """``Q diag(exp(l)) Q^T``, ``Q`` Haar-orthogonal, ``l ~ N(0, 1)``."""
        q, r = np.linalg.qr(rng.standard_normal((self.n, self.n)))
        q = q * np.where(np.diag(r) < 0, -1.0, 1.0)
        return _sym((q * np.exp(rng.standard_normal(self.n))) @ q.T)

    def feasibility(self, x: np.ndarray) -> np.ndarray:
        """``||X - X^T||_F`` per batch element, ``inf`` where ``sym(X)`` is not positive definite."""
        x = self._arr(x, "point x")
        asym = np.linalg.norm(x - np.swapaxes(x, -1, -2), axis=(-2, -1))
        lam_min = np.linalg.eigvalsh(_sym(x))[..., 0]
        return np.where(lam_min > 0, asym, np.inf)

    def tangent_error(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """``||U - sym(U)||_F`` per batch element."""
        u = self._arr(u, "vector u")
        return np.linalg.norm(0.5 * (u - np.swapaxes(u, -1, -2)), axis=(-2, -1))


class PoincareBall(Manifold):
    """Poincaré ball ``{x in R^n: c ||x||^2 < 1}`` of curvature ``-c`` (the authors used the
    isometric Lorentz model).

    Numpy closed forms of geoopt's ``PoincareBall(c)``: metric ``lambda_x^2 <u, v>``,
    ``lambda_x = 2/(1 - c||x||^2)``; retraction = exponential map, clipped like geoopt to
    ``sqrt(c)||x|| <= 1 - 1e-5``. Not compact: RFedProj refuses it. ValueError unless ``n >= 1``
    and ``c > 0``.
    """

    #: geoopt's float64 boundary margin (``sqrt(c)||x|| <= 1 - BALL_EPS``).
    BALL_EPS = 1e-5

    def __init__(self, n: int, c: float = 1.0) -> None:
        if int(n) != n or n < 1:
            raise ValueError(f"PoincareBall(n) needs an integer n >= 1, got n={n}")
        if not (np.isfinite(c) and c > 0):
            raise ValueError(f"PoincareBall curvature c must be positive, got c={c!r}")
        self.n, self.c = int(n), float(c)
        self.point_shape = (self.n,)
        self._geo = _geoopt().PoincareBall(c=self.c)  # the reference
        self._constraint = "max(0, sqrt(c)||x|| - (1 - 1e-5))"

    def __repr__(self) -> str:
        return f"PoincareBall(n={self.n}, c={self.c})"

    # Möbius helpers (keepdims norms on the last axis)
    def _madd(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        c = self.c
        xy = np.sum(x * y, axis=-1, keepdims=True)
        x2 = np.sum(x * x, axis=-1, keepdims=True)
        y2 = np.sum(y * y, axis=-1, keepdims=True)
        num = (1 + 2 * c * xy + c * y2) * x + (1 - c * x2) * y
        return num / np.maximum(1 + 2 * c * xy + c**2 * x2 * y2, 1e-15)

    def _lam(self, x: np.ndarray) -> np.ndarray:
        return 2.0 / np.maximum(1.0 - self.c * np.sum(x * x, axis=-1, keepdims=True), 1e-15)

    def _project(self, x: np.ndarray) -> np.ndarray:
        nx = np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-15)
        maxnorm = (1.0 - self.BALL_EPS) / np.sqrt(self.c)
        return np.where(nx > maxnorm, x / nx * maxnorm, x)

    def proj(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Identity (``T_x B = R^n``), broadcast to the common shape."""
        x, u = self._arr(x, "point x"), self._arr(u, "vector u")
        return np.broadcast_to(u, np.broadcast_shapes(x.shape, u.shape)).copy()

    def egrad2rgrad(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        """``g / lambda_x^2``."""
        x, g = self._arr(x, "point x"), self._arr(g, "gradient g")
        return g / self._lam(x) ** 2

    def rgrad2egrad(self, x: np.ndarray, v: np.ndarray) -> np.ndarray:
        """``lambda_x^2 v`` (inverse of ``egrad2rgrad``)."""
        x, v = self._arr(x, "point x"), self._arr(v, "vector v")
        return self._lam(x) ** 2 * v

    def retr(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Exponential map ``Exp_x(u)``, clipped inside the ball."""
        x, u = self._arr(x, "point x"), self._arr(u, "vector u")
        sc = np.sqrt(self.c)
        nu = np.maximum(np.linalg.norm(u, axis=-1, keepdims=True), 1e-15)
        second = np.tanh(sc * self._lam(x) * nu / 2) * u / (sc * nu)
        return self._project(self._madd(x, second))

    def log(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Riemannian logarithm ``Log_x(y)``."""
        x, y = self._arr(x, "point x"), self._arr(y, "point y")
        sc = np.sqrt(self.c)
        w = self._madd(-x, y)
        nw = np.maximum(np.linalg.norm(w, axis=-1, keepdims=True), 1e-15)
        return 2.0 / (sc * self._lam(x)) * np.arctanh(np.minimum(sc * nw, 1 - 1e-15)) * w / nw

    #: the retraction is the exponential map: its inverse is the logarithm
    invretr = log

    def dist(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``2/sqrt(c) artanh(sqrt(c)||(-x) (+) y||)`` per batch element."""
        x, y = self._arr(x, "point x"), self._arr(y, "point y")
        sc = np.sqrt(self.c)
        nw = np.linalg.norm(self._madd(-x, y), axis=-1)
        return 2.0 / sc * np.arctanh(np.minimum(sc * nw, 1 - 1e-15))

    def transp(self, x: np.ndarray, y: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Parallel transport ``gyr[y, -x] v * lambda_x / lambda_y`` (geoopt's formula)."""
        x, y, v = self._arr(x, "point x"), self._arr(y, "point y"), self._arr(v, "vector v")
        a, b = y, -x
        gyr = self._madd(-self._madd(a, b), self._madd(a, self._madd(b, v)))
        return gyr * self._lam(x) / self._lam(y)

    def inner(self, x: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Metric ``lambda_x^2 <u, v>`` per batch element."""
        x, u, v = self._arr(x, "point x"), self._arr(u, "vector u"), self._arr(v, "vector v")
        return self._lam(x)[..., 0] ** 2 * np.sum(u * v, axis=-1)

    def random_point(self, rng: np.random.Generator) -> np.ndarray:
        """``Exp_0(g)``, ``g ~ N(0, I_n / n)``."""
        return self.retr(np.zeros(self.n), rng.standard_normal(self.n) / np.sqrt(self.n))

    def feasibility(self, x: np.ndarray) -> np.ndarray:
        """``max(0, sqrt(c)||x|| - (1 - 1e-5))`` per batch element."""
        x = self._arr(x, "point x")
        return np.maximum(0.0, np.sqrt(self.c) * np.linalg.norm(x, axis=-1) - (1.0 - self.BALL_EPS))

    def tangent_error(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """0 for any finite ``u`` (every vector is tangent), ``inf`` otherwise."""
        u = self._arr(u, "vector u")
        return np.where(np.all(np.isfinite(u), axis=-1), 0.0, np.inf)
