r"""Curvature: operators with one ``matvec`` protocol, and the probes that take any of them.

- :mod:`~lsdl_lab.curvature.operators`: :class:`CurvatureOperator` (the protocol),
  :class:`HessianOperator` (Pearlmutter's Hessian-vector products of a model's loss),
  :class:`DenseOperator` (an explicit symmetric matrix), :func:`hessian_matrix` (the exact
  Hessian of a small model);
- :mod:`~lsdl_lab.curvature.gauss_newton`: :class:`GGNOperator` (the generalized
  Gauss-Newton) and :class:`FisherOperator` (the Fisher, Monte-Carlo, or the empirical
  Fisher), cross-checked against curvlinops;
- :mod:`~lsdl_lab.curvature.probes`: :func:`top_eigenvalues` (Lanczos, or power iteration),
  :func:`lanczos`, :func:`lanczos_eigenvalues`, :func:`trace` (Hutchinson, Hutch++, XTrace)
  and :func:`spectral_density` (stochastic Lanczos quadrature), cross-checked against
  PyHessian (Yao et al., 2020) and curvlinops;
- :mod:`~lsdl_lab.curvature.conjugate_gradient`: :func:`cg`, conjugate gradients on any
  operator (with damping, a budget, a stopping rule, a warm start, and the iterates it
  keeps for Hessian-free's backtracking).

    from lsdl_lab import curvature
    H = curvature.HessianOperator(model, F.cross_entropy, [(x, y)])
    (lam_max,), _ = curvature.top_eigenvalues(H)
"""

from .conjugate_gradient import CGInfo, Iterate, cg
from .gauss_newton import FisherOperator, GGNOperator
from .operators import (
    CurvatureOperator,
    DenseOperator,
    HessianOperator,
    ParameterOperator,
    affine_batchnorm,
    hessian_matrix,
)
from .probes import (
    SpectralDensity,
    lanczos,
    lanczos_eigenvalues,
    spectral_density,
    top_eigenvalues,
    trace,
)

__all__ = [
    "CGInfo",
    "CurvatureOperator",
    "DenseOperator",
    "FisherOperator",
    "GGNOperator",
    "HessianOperator",
    "Iterate",
    "ParameterOperator",
    "SpectralDensity",
    "affine_batchnorm",
    "cg",
    "hessian_matrix",
    "lanczos",
    "lanczos_eigenvalues",
    "spectral_density",
    "top_eigenvalues",
    "trace",
]
