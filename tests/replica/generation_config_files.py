"""Real checkpoints on disk (the built-in model's files) whose generation_config.json recommends
sampling parameters, as a model author's does: for the tests of the defaults they give requests
(tests/replica/test_generation_config.py, tests/cluster/test_sampling_defaults.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from replica.core.request import SamplingParams
from replica.model.registry import resolve_model_path

# top_k 1 makes the recommended sampling greedy, so its effect shows in the tokens: they are the
# greedy ones under a strong repetition penalty, and at most 6 of them. do_sample false is not
# read (as vLLM does not read it): the temperature stands.
RECOMMENDED = {"temperature": 0.7, "top_k": 1, "repetition_penalty": 5.0, "max_new_tokens": 6, "do_sample": False}
RECOMMENDED_PARAMS = SamplingParams(temperature=0.7, top_k=1, repetition_penalty=5.0)
RECOMMENDED_MAX_TOKENS = 6


def recommending_checkpoint(target: Path, **generation_config) -> Path:
    """The built-in model's files at `target`, its generation_config.json adding RECOMMENDED (or
    `generation_config`) to its token ids."""
    shutil.copytree(resolve_model_path("builtin"), target)
    path = target / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **(generation_config or RECOMMENDED)}))
    return target
