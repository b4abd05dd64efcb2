"""The workers: the pool, registration, discovery and the autoscaling signal.

Modules:

- ``pool``: The worker pool: who can be routed to, and how loaded each worker is right now.
- ``registration``: Who may register a worker, and which addresses a registration may aim the router
  at.
- ``scaling_signal``: Prefix-aware autoscaling: how many workers the fleet needs *now* (a pure
  signal).
- ``discovery``: Worker discovery (``workers.discovery``): Kubernetes EndpointSlices (``k8s``), a
  Gateway API Inference Extension InferencePool's pods (``inference_pool``, for ``radixfleet gateway
  --inference-pool``) and DNS A/AAAA records of a headless Service (``dns``), applied to the pool as
  diffs (``reconcile``) by ``Discovery`` (``manager``).
"""
