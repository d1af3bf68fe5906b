"""The Ray Serve application of one served model (`import_path: cluster.app:build_app`): the
Ingress in front of the LLMReplica deployment, built from a ClusterConfig validated here, so a
bad config fails at start with the field's dotted path.
"""

from __future__ import annotations

from typing import Any, Mapping

from ray import serve

from cluster.config import ClusterConfig, load_config
from cluster.deployment import build_llm_replica
from cluster.ingress import Ingress


def build_app(args: Mapping[str, Any]) -> serve.Application:
    """The application for `args`, a ClusterConfig mapping (a Serve config's `args`)."""
    return build_app_from_config(load_config(dict(args)).applications[0].args)


def build_app_from_config(config: ClusterConfig) -> serve.Application:
    return Ingress.bind(build_llm_replica(config), config)
