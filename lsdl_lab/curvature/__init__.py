r"""Curvature: operators with one ``matvec`` protocol, and the probes that take any of them.

- :mod:`~lsdl_lab.curvature.operators`: :class:`CurvatureOperator` (the protocol),
  :class:`HessianOperator` (Pearlmutter's Hessian-vector products of a model's loss),
  :class:`DenseOperator` (an explicit symmetric matrix), :func:`hessian_matrix` (the exact
  Hessian of a small model);
- :mod:`~lsdl_lab.curvature.probes`: :func:`top_eigenvalues`, :func:`lanczos`,
  :func:`lanczos_eigenvalues`, :func:`trace` (Hutchinson) and :func:`spectral_density`
  (stochastic Lanczos quadrature), cross-checked against PyHessian (Yao et al., 2020).

    from lsdl_lab import curvature
    H = curvature.HessianOperator(model, F.cross_entropy, [(x, y)])
    (lam_max,), _ = curvature.top_eigenvalues(H)
"""

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
    "CurvatureOperator",
    "DenseOperator",
    "HessianOperator",
    "ParameterOperator",
    "SpectralDensity",
    "affine_batchnorm",
    "hessian_matrix",
    "lanczos",
    "lanczos_eigenvalues",
    "spectral_density",
    "top_eigenvalues",
    "trace",
]
