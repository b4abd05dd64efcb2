"""Worker discovery (``workers.discovery``): Kubernetes EndpointSlices (``k8s``), a
Gateway API Inference Extension InferencePool's pods (``inference_pool``, for
``radixfleet gateway --inference-pool``) and DNS A/AAAA records of a headless
Service (``dns``), applied to the pool as diffs
(``reconcile``) by ``Discovery`` (``manager``). ``base`` holds the narrow source
interface: a source yields the desired set of ``Endpoint(id, url, kind)``."""

from radixfleet.fleet.discovery.base import Endpoint, SourceError
from radixfleet.fleet.discovery.manager import Discovery

__all__ = ["Discovery", "Endpoint", "SourceError"]
