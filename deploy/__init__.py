"""Bringing a cluster up: worker pools on Ray (``ray_pools``) or in one process (``local``),
plus the Kubernetes (KubeRay) manifests next to this package."""
