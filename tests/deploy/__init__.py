"""Tests of deploy/: the container image, the Kubernetes manifests, the Grafana dashboard."""
