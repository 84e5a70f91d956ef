"""Manifolds for RFedAGS: Stiefel ``St(d, r)`` and the unit sphere ``S^{n-1}`` (numpy, float64).

The geometry is delegated to ``geoopt`` (a maintained library) after checking that it matches the
operators of the RFedAGS authors' code (Manopt defaults; docs/baselines.md, s5.4):

* Stiefel: ``geoopt.EuclideanStiefel`` (NOT ``geoopt.Stiefel()``, which defaults to the canonical
  metric and the Cayley retraction). Its tangent projection is ``U - X sym(X^T U)``, its retraction
  is ``qf(X + U)`` with the columns of ``Q`` multiplied by ``sign(diag R)`` (``sign(0) := +1``) so that
  ``R_X(0) = X``, and its vector transport is the projection onto the target tangent space:
  identical to Manopt's ``stiefelfactory`` (``qr_unique`` retraction, projection ``transp``).
* Sphere: ``geoopt.Sphere`` gives the normalisation retraction ``(x + u)/||x + u||`` and the
  projection transport (Manopt ``spherefactory`` defaults). The authors' MNIST sphere experiment
  overrode these with the exponential map and parallel transport; both are offered as options
  (``retraction="exp"`` uses ``geoopt.Sphere.expmap``; ``transport="parallel"`` is a 3-line closed
  form implemented here because geoopt has no sphere parallel transport).

Arrays are numpy; every operation casts its inputs to float64 and returns float64. Leading batch
axes broadcast (``(..., d, r)`` for Stiefel, ``(..., n)`` for the sphere), which lets one call run
the local steps of many clients at once. Points are never re-validated inside the hot loop; use
:meth:`Stiefel.check_point` / :meth:`Sphere.check_point` when a check is wanted.

Sign and metric conventions: the metric is the Euclidean one inherited from the embedding space
(``<U, V> = tr(U^T V)``), so the Riemannian gradient is the tangent projection of the Euclidean
gradient (``grad f = P_x(nabla f)``, standard for embedded submanifolds; docs/baselines.md, s5.2).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator, Protocol

import numpy as np

with warnings.catch_warnings():
    # geoopt 0.5 decorates helpers with torch.jit.script, deprecated in recent torch.
    warnings.simplefilter("ignore", FutureWarning)
    import geoopt
    import torch

__all__ = ["Manifold", "Stiefel", "Sphere", "as_float64"]


def as_float64(a: np.ndarray | float, name: str = "array") -> np.ndarray:
    """Return ``a`` as a C-contiguous float64 numpy array.

    Args:
        a: array-like (numpy array, list, torch tensor on CPU).
        name: label for error messages.

    Returns:
        float64 ndarray with the same shape.

    Raises:
        ValueError: if ``a`` contains NaN or inf.
    """
    out = np.ascontiguousarray(np.asarray(a, dtype=np.float64))
    if not np.all(np.isfinite(out)):
        raise ValueError(f"{name}: {int(np.size(out) - np.isfinite(out).sum())} NaN/inf entries")
    return out


@contextmanager
def _single_thread_torch() -> Iterator[None]:
    """Run torch with one intra-op thread for the duration of a manifold call.

    The matrices here are tiny (``d x r``): multi-threading gains nothing, and on a loaded 2-core
    machine torch's OpenMP barriers made a 1500-round test 10-20x slower (measured 1.6 s with one
    thread vs 17-36 s with two). ``torch.set_num_threads`` is process-global and costs ~0.3 us; the
    previous value is restored on exit (not safe against *other threads* running torch meanwhile,
    which would briefly see one intra-op thread).
    """
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n != 1:
            torch.set_num_threads(n)


def _t(a: np.ndarray) -> torch.Tensor:
    # torch.from_numpy shares memory; read-only inputs (e.g. from an ArrayRecord) are copied first.
    return torch.from_numpy(a if a.flags.writeable else a.copy())


class Manifold(Protocol):
    """The operations RFedAGS needs from a manifold (docs/baselines.md, s5.2 and s5.4).

    ``proj(x, u)``: orthogonal projection of an ambient vector onto ``T_x M``.
    ``egrad2rgrad(x, g)``: Riemannian gradient from the Euclidean gradient (= ``proj`` for the
    embedded metric). ``retr(x, u)``: retraction ``R_x(u)``. ``transp(x, y, v)``: vector transport
    of ``v in T_x M`` to ``T_y M``. ``inner(x, u, v)``: metric. ``point_shape``: shape of one point.
    ``feasibility(x)`` / ``tangent_error(x, u)``: distance from the constraint / from ``T_x M``
    (0 when satisfied); ``check_point`` raises ``ValueError`` when off the manifold.
    """

    point_shape: tuple[int, ...]

    def proj(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Projection of ambient ``u`` onto ``T_x M``; float64, shape ``(..., *point_shape)``."""

    def egrad2rgrad(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Riemannian gradient at ``x`` from the Euclidean gradient ``g``; float64, shape of ``g``."""

    def retr(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Retraction ``R_x(u)`` of a tangent vector; float64 point(s), shape ``(..., *point_shape)``."""

    def transp(self, x: np.ndarray, y: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Vector transport of ``v in T_x M`` to ``T_y M``; float64, shape of ``v``."""

    def inner(self, x: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Metric ``<u, v>_x`` per batch element; float64 of shape ``(...)``."""

    def random_point(self, rng: np.random.Generator) -> np.ndarray:
        """A random point of shape ``point_shape`` (float64) drawn with ``rng``."""

    def feasibility(self, x: np.ndarray) -> np.ndarray:
        """Distance of ``x`` from the constraint per batch element (0 on ``M``); float64 ``(...)``."""

    def check_point(self, x: np.ndarray, atol: float = 1e-8) -> None:
        """Raise ``ValueError`` unless ``x`` is finite, well-shaped and on ``M`` up to ``atol``."""

    def tangent_error(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Distance of ``u`` from ``T_x M`` per batch element (0 if tangent); float64 ``(...)``."""


class _GeooptEmbedded:
    """Shared plumbing of the embedded manifolds below (geoopt backend, numpy in/out).

    Subclasses set ``point_shape`` (trailing shape of a point), ``_geo`` (a geoopt manifold),
    ``_constraint`` (how :meth:`feasibility` measures the distance from the manifold, for error
    messages) and implement ``inner``, ``feasibility`` and ``retr``.
    """

    point_shape: tuple[int, ...]
    _constraint: str

    def _arr(self, a: np.ndarray, name: str) -> np.ndarray:
        """float64 contiguous copy of ``a``; ValueError if its trailing shape is not ``point_shape``."""
        out = np.ascontiguousarray(np.asarray(a, dtype=np.float64))
        k = len(self.point_shape)
        if out.shape[-k:] != self.point_shape:
            raise ValueError(f"{name}: expected shape (..., {', '.join(map(str, self.point_shape))}) on {self!r}, got {out.shape}")
        return out

    def _proju(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """geoopt's tangent projection of already-validated float64 arrays."""
        with _single_thread_torch():
            return self._geo.proju(_t(x), _t(u)).numpy()

    def proj(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Tangent projection at ``x`` (Stiefel: ``U - X sym(X^T U)``; sphere: ``u - <x, u> x``).

        Args:
            x: point(s) of shape ``(..., *point_shape)``.
            u: ambient vector(s) of shape ``(..., *point_shape)`` (broadcast against ``x``).

        Returns:
            float64 tangent vector(s) of the broadcast shape.

        Raises:
            ValueError: a trailing shape other than ``point_shape``.
        """
        return self._proju(self._arr(x, "point x"), self._arr(u, "vector u"))

    def egrad2rgrad(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Riemannian gradient of the embedded metric = ``proj(x, g)``; float64, shape of ``g``
        (docs/baselines.md, s5.2). Raises ValueError like :meth:`proj`."""
        return self.proj(x, g)

    def norm(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Norm ``sqrt(<u, u>)`` of tangent vector(s) ``u`` at ``x``; float64 of shape ``(...)``.
        Raises ValueError like :meth:`proj`."""
        return np.sqrt(self.inner(x, u, u))

    def check_point(self, x: np.ndarray, atol: float = 1e-8) -> None:
        """Raise ``ValueError`` unless ``x`` has shape ``(..., *point_shape)``, is finite and lies on
        the manifold up to ``atol`` (:meth:`feasibility`; Stiefel ``||X^T X - I||_F``, sphere
        ``| ||x|| - 1 |``)."""
        x = self._arr(x, "point x")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"point x on {self!r} has NaN/inf entries")
        err = float(np.max(self.feasibility(x)))
        if err > atol:
            raise ValueError(f"point x is off {self!r}: {self._constraint} = {err:.3e} > atol={atol}")


class Stiefel(_GeooptEmbedded):
    """Stiefel manifold ``St(d, r) = {X in R^{d x r}: X^T X = I_r}`` with the embedded metric.

    Implements the operators of docs/baselines.md, s5.4 for Stiefel problems (PCA):
    projection ``P_X(U) = U - X sym(X^T U)``, QR retraction with sign fix, projection transport.

    Args:
        d: ambient rows, ``d >= r >= 1``.
        r: columns.

    Raises:
        ValueError: if ``r < 1`` or ``d < r``.

    All methods accept points/vectors of shape ``(..., d, r)`` (leading batch axes broadcast) as any
    float array and return float64 numpy arrays of the broadcast shape.
    """

    def __init__(self, d: int, r: int) -> None:
        if int(r) != r or int(d) != d or r < 1 or d < r:
            raise ValueError(f"Stiefel(d, r) needs integers d >= r >= 1, got d={d}, r={r}")
        self.d, self.r = int(d), int(r)
        self.point_shape = (self.d, self.r)
        self._geo = geoopt.EuclideanStiefel()
        self._constraint = "||X^T X - I||_F"

    def __repr__(self) -> str:
        return f"Stiefel(d={self.d}, r={self.r})"

    def retr(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """QR retraction ``qf(X + U)``, columns sign-fixed so ``diag(R) >= 0`` (``R_X(0) = X``).

        Shapes ``(..., d, r)``; returns float64 points with orthonormal columns.

        Raises:
            ValueError: a trailing shape other than ``(d, r)``.
        """
        x, u = self._arr(x, "point x"), self._arr(u, "vector u")
        with _single_thread_torch():
            return self._geo.retr(_t(x), _t(u)).numpy()

    def transp(self, x: np.ndarray, y: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Projection vector transport ``T_{x->y}(v) = P_y(v)`` (Manopt ``transp``); float64,
        shape ``(..., d, r)``. Raises ValueError on a trailing shape other than ``(d, r)``."""
        self._arr(x, "point x")
        return self._proju(self._arr(y, "point y"), self._arr(v, "vector v"))

    def inner(self, x: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Euclidean metric ``tr(U^T V)`` per batch element; returns shape ``(...)`` float64."""
        u, v = self._arr(u, "vector u"), self._arr(v, "vector v")
        return np.sum(u * v, axis=(-2, -1))

    def random_point(self, rng: np.random.Generator) -> np.ndarray:
        """Random point ``qf(G)`` with ``G`` standard normal ``(d, r)`` (Haar-distributed), float64."""
        g = rng.standard_normal(self.point_shape)
        return self.retr(np.zeros(self.point_shape), g)

    def feasibility(self, x: np.ndarray) -> np.ndarray:
        """``||X^T X - I_r||_F`` per batch element (0 on the manifold), float64."""
        x = self._arr(x, "point x")
        gram = np.swapaxes(x, -1, -2) @ x
        return np.linalg.norm(gram - np.eye(self.r), axis=(-2, -1))

    def tangent_error(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """``||sym(X^T U)||_F`` per batch element (0 iff ``U in T_X St``), float64."""
        x, u = self._arr(x, "point x"), self._arr(u, "vector u")
        xtu = np.swapaxes(x, -1, -2) @ u
        return np.linalg.norm(0.5 * (xtu + np.swapaxes(xtu, -1, -2)), axis=(-2, -1))


class Sphere(_GeooptEmbedded):
    """Unit sphere ``S^{n-1} = {x in R^n: ||x|| = 1}`` with the embedded metric.

    Args:
        n: ambient dimension, ``n >= 2``.
        retraction: ``"normalize"`` (default, Manopt ``spherefactory``: ``(x+u)/||x+u||``) or
            ``"exp"`` (exponential map, what the authors' MNIST sphere experiment used).
        transport: ``"projection"`` (default, ``P_y(v) = v - <y, v> y``) or ``"parallel"``
            (parallel transport along the minimising geodesic,
            ``v - <y, v>/(1 + <x, y>) (x + y)``; undefined for antipodal ``x = -y``).

    Raises:
        ValueError: bad ``n``, unknown ``retraction``/``transport``.

    Points and vectors have shape ``(..., n)``; all outputs are float64 numpy arrays.
    """

    def __init__(self, n: int, retraction: str = "normalize", transport: str = "projection") -> None:
        if int(n) != n or n < 2:
            raise ValueError(f"Sphere(n) needs an integer n >= 2, got n={n}")
        if retraction not in ("normalize", "exp"):
            raise ValueError(f"retraction must be 'normalize' or 'exp', got {retraction!r}")
        if transport not in ("projection", "parallel"):
            raise ValueError(f"transport must be 'projection' or 'parallel', got {transport!r}")
        self.n = int(n)
        self.point_shape = (self.n,)
        self.retraction, self.transport = retraction, transport
        self._geo = geoopt.Sphere()
        self._constraint = "| ||x|| - 1 |"

    def __repr__(self) -> str:
        return f"Sphere(n={self.n}, retraction={self.retraction!r}, transport={self.transport!r})"

    def retr(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Retraction (normalisation or exponential map, see class doc); float64 ``(..., n)``.
        Raises ValueError on a trailing shape other than ``(n,)``."""
        x, u = self._arr(x, "point x"), self._arr(u, "vector u")
        f = self._geo.expmap if self.retraction == "exp" else self._geo.retr
        with _single_thread_torch():
            return f(_t(x), _t(u)).numpy()

    def transp(self, x: np.ndarray, y: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Vector transport ``T_{x->y}(v)`` (projection or parallel, see class doc); float64.

        Raises:
            ValueError: parallel transport between (numerically) antipodal points.
        """
        x, y, v = self._arr(x, "point x"), self._arr(y, "point y"), self._arr(v, "vector v")
        if self.transport == "projection":
            return self._proju(y, v)
        xy = np.sum(x * y, axis=-1, keepdims=True)
        if np.any(1.0 + xy < 1e-12):
            raise ValueError("parallel transport on the sphere is undefined for antipodal x, y")
        return v - np.sum(y * v, axis=-1, keepdims=True) / (1.0 + xy) * (x + y)

    def inner(self, x: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Euclidean inner product ``<u, v>`` per batch element; float64 of shape ``(...)``.
        Raises ValueError on a trailing shape other than ``(n,)``."""
        u, v = self._arr(u, "vector u"), self._arr(v, "vector v")
        return np.sum(u * v, axis=-1)

    def random_point(self, rng: np.random.Generator) -> np.ndarray:
        """Uniformly distributed unit vector ``(n,)`` float64 (normalised standard normal drawn
        with ``rng``)."""
        g = rng.standard_normal(self.point_shape)
        return g / np.linalg.norm(g)

    def feasibility(self, x: np.ndarray) -> np.ndarray:
        """``| ||x|| - 1 |`` per batch element (0 on the sphere); float64 of shape ``(...)``."""
        x = self._arr(x, "point x")
        return np.abs(np.linalg.norm(x, axis=-1) - 1.0)

    def tangent_error(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """``|<x, u>|`` per batch element (0 iff ``u in T_x S``), float64."""
        x, u = self._arr(x, "point x"), self._arr(u, "vector u")
        return np.abs(np.sum(x * u, axis=-1))
