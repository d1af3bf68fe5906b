"""The cluster token: the secret routers and `headroom status` present to every replica's
internal endpoint (LoadReporter on ports.replica_grpc), which refuses each call without it.

One per Ray cluster, made when the first application is built on it and kept in Ray's GCS
key-value store, where every process of the cluster reads it: so it is never a command-line
argument (visible in `ps`), a Serve deployment option (Serve's REST API and dashboard show
those, the router's kwargs included), a routing stat, a log line or a metric label. Whoever
joins the Ray cluster can read it, and could run any code on the cluster anyway: Ray
membership is the trust boundary here as everywhere in the cluster. Rebuilding an application
keeps it, so during a rolling update old routers and new replicas still agree.
"""

from __future__ import annotations

import secrets

from ray.experimental import internal_kv

# Named in the replica's refusal ("missing or invalid cluster token"); never the value.
CREDENTIAL_NAME = "cluster token"
_KV_NAMESPACE = "headroom"
_KV_KEY = b"cluster-token"


def cluster_token() -> str:
    """This Ray cluster's token, made now if no process has yet (needs Ray connected)."""
    token = internal_kv._internal_kv_get(_KV_KEY, namespace=_KV_NAMESPACE)
    if token is None:
        # Of processes racing to make it, the first write wins and every one reads that one.
        internal_kv._internal_kv_put(_KV_KEY, secrets.token_urlsafe(32).encode(), overwrite=False,
                                     namespace=_KV_NAMESPACE)
        token = internal_kv._internal_kv_get(_KV_KEY, namespace=_KV_NAMESPACE)
    return token.decode()
