"""Kernel families: each module loads its CUDA source, compiles through ``build`` and launches.

Every family module offers the same small interface, used by ``dispatch``:

- ``NAME``: the option value that selects it (``kernel="portable"``, ...);
- ``supports(problem, limits) -> bool``;
- ``forward(q, k, v, o, lse, problem)`` on 4-D (B, H, N, D) CuPy views, lse (B, Hq, Nq) float32;
- ``backward(do, q, k, v, o, lse, dq, dk, dv, problem)``;
- ``instantiations() -> list[(source, name_expression)]`` for the CI compile check.
"""
