"""The two names headroom takes from Ray Serve's private modules, in one place, because Ray
Serve 2.60 has no public API for either:

- SERVE_NAMESPACE: the Ray namespace Serve's actors live in. `headroom status` and the
  deployment's replica listing look replica actors up by name there (ray.get_actor needs the
  namespace; Serve's public status API does not expose the actors).
- gRPCStreamingType: the kind of gRPC method Serve's proxy builds a handler for. Our proxy
  extension (cluster/grpc_proxy.py) registers headroom.v1.Generation's handlers through the
  proxy's own `service_handler_factory`, which takes it.

When Ray upgrades, this module is the one place to check."""

from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve._private.proxy_request_response import gRPCStreamingType

__all__ = ["SERVE_NAMESPACE", "gRPCStreamingType"]
